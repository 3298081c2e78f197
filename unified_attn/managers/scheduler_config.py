"""What the scheduler knows about the KV cache: a block budget and each group's policy."""

from __future__ import annotations

from typing import Any

import attrs


def _as_group(value: Any) -> KVCacheGroup:
    if isinstance(value, KVCacheGroup):
        return value
    if isinstance(value, tuple) and len(value) in (2, 3):
        return KVCacheGroup(*value)
    raise TypeError(
        f"a KV-cache group must be KVCacheGroup or (manager_cls, config[, block_size]), "
        f"got {value!r}"
    )


def _as_groups(values: Any) -> tuple[KVCacheGroup, ...]:
    return tuple(_as_group(v) for v in values)


@attrs.frozen
class KVCacheGroup:
    """One group: the manager class, its policy config and (optionally) its own block size."""

    manager_cls: type = attrs.field()
    config: Any = attrs.field()
    block_size: int | None = None

    @config.validator
    def _check_config(self, _attribute: attrs.Attribute, value: Any) -> None:
        expected = getattr(self.manager_cls, "Config", None)
        if expected is None or not isinstance(value, expected):
            raise TypeError(
                f"{self.manager_cls.__name__} needs a {self.manager_cls.__name__}.Config, "
                f"got {type(value).__name__}"
            )


@attrs.frozen
class SchedulerKVCacheConfig:
    """`num_blocks` shared by all groups, `block_size` tokens per block unless a group says."""

    num_blocks: int
    block_size: int
    groups: tuple[KVCacheGroup, ...] = attrs.field(converter=_as_groups)

    def __attrs_post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        for i, group in enumerate(self.groups):
            if group.block_size is not None and group.block_size <= 0:
                raise ValueError(f"group {i}: block_size must be positive, got {group.block_size}")

    def group_block_size(self, group_id: int) -> int:
        return self.groups[group_id].block_size or self.block_size
