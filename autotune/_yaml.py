"""Reading YAML that a user hands autotune: safe, bounded, and refused in one line.

``yaml.safe_load`` builds no objects, but it expands aliases into shared references (a
"billion laughs" file is small on disk and enormous once printed), recurses once per
level of nesting, and turns a 5000-digit number into a ``ValueError``. autotune's files
use none of these, so each is refused as a :class:`~autotune.errors.ConfigError` before
anything is built.
"""

from __future__ import annotations

from typing import Any

import yaml

from autotune.errors import ConfigError

__all__ = ["MAX_BYTES", "read_yaml", "too_large"]

MAX_BYTES = 256 * 2**10
"""The largest file read; a tuned result with every trial is tens of kilobytes. This
loader (pure Python, for the checks below) reads about 0.3 MiB a second on a 2-core
machine: a file at the limit is read in under a second, a larger one refused at once."""
_MAX_DEPTH = 32
"""The deepest nesting read; a tuned result nests five levels."""


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` without aliases and with bounded nesting."""

    depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
            raise ConfigError(
                f"line {mark.line + 1}: YAML aliases (*name) are not read by autotune; "
                "write the value out."
            )
        self.depth += 1
        try:
            if self.depth > _MAX_DEPTH:
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
                raise ConfigError(
                    f"line {mark.line + 1}: nested deeper than {_MAX_DEPTH} levels; "
                    "this is not an autotune file."
                )
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        """A mapping, refused where a key repeats (YAML would keep the last value)."""
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                try:
                    repeated = key in seen
                except TypeError:  # unhashable: the constructor says so
                    break
                if repeated:
                    raise ConfigError(
                        f"line {key_node.start_mark.line + 1}: key {str(key)[:40]!r} is given "
                        "twice; keep one (YAML would silently keep the last)."
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def too_large(source: str, size: int) -> ConfigError:
    """The error for a file of ``size`` bytes, over what autotune reads."""
    return ConfigError(
        f"{source} is {size / 2**10:,.0f} KiB; autotune files are far smaller "
        f"(at most {MAX_BYTES // 2**10} KiB read). Is it the right file?"
    )


def read_yaml(text: str, source: str) -> Any:
    """Parse ``text`` (from ``source``, for messages) as plain YAML data.

    Raises:
        ConfigError: the text is too large, not YAML, uses aliases, nests too deep,
            repeats a key or holds a number Python will not convert.
    """
    if len(text) > MAX_BYTES:
        raise too_large(source, len(text))
    try:
        return yaml.load(text, Loader=_Loader)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source} is not valid YAML: {' '.join(str(exc).split())}") from None
    except (ValueError, OverflowError) as exc:  # e.g. an integer of thousands of digits
        raise ConfigError(f"{source} holds a value autotune cannot read: {exc}") from None
