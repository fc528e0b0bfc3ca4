"""What the Fabric strategies of lightning_qcomm share (Lightning layer): settings from a config dataclass, the
cross-rank settings check at setup, one checkpoint entry of their own, the background comm thread, the
registry names.

``fabric.save`` hands the strategy a ``state`` dict; ``checkpoint_entry(state)`` (collective) returns what the
method must keep: the entry stored under ``checkpoint_key`` in the checkpoint, and this rank's own entry, which
every rank writes to its side file (``parallel.rank_files``). ``fabric.load`` returns the items it did not
restore; the strategy takes its entry out of them and gives it, with this rank's side-file entry, to
``restore_entry``.

Example::

    class MyFabricStrategy(QCommFabricStrategy, DDPStrategy):
        checkpoint_key = "mine"
        presets = {"mine": ("what it does", {})}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning.fabric.strategies import ParallelStrategy
from lightning.fabric.utilities.types import _PATH
from typing_extensions import override

from lightning_qcomm._checks import START_METHODS, build_as, check_choice, check_timeout
from lightning_qcomm.comm.comm_worker import BackgroundComm
from lightning_qcomm.comm.consistency import check_same_config, presence_timeout
from lightning_qcomm.comm.process_group import destroy_gloo_group_at_exit
from lightning_qcomm.parallel import rank_files
from lightning_qcomm.strategies.presets import Presets, register_presets


def config_from(owner: str, config_cls: type, config: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The strategy's config: ``config`` itself, or built from the config fields among ``kwargs`` (checked,
    errors naming ``owner``), not both. Returns it and the other kwargs (the Fabric base class's)."""
    fields = {k: kwargs.pop(k) for k in list(kwargs) if k in config_cls.__dataclass_fields__}
    if config is None:
        return build_as(owner, config_cls, fields), kwargs
    if not isinstance(config, config_cls):
        raise TypeError(f"{owner}(config={config!r}) must be a {config_cls.__name__}")
    if fields:
        raise ValueError(f"{owner}: pass config= or its fields ({', '.join(sorted(fields))}), not both")
    return config, kwargs


def check_fabric_ddp_kwargs(owner: str, kwargs: dict[str, Any]) -> None:
    """The arguments of Fabric's ``DDPStrategy`` that it does not check itself."""
    check_choice(owner, "start_method", kwargs.get("start_method", "popen"), START_METHODS)
    check_timeout(owner, kwargs.get("timeout"))


def check_one_module(owner: str, current: Any, module: Any) -> None:
    """Refuse a second model on a strategy whose per-step state belongs to one (Fabric's two-``fabric.setup`` GAN
    pattern): the first model's state would be silently replaced. Setting up the same module again is fine."""
    if current is not None and current is not module:
        raise ValueError(
            f"{owner} runs one model per strategy, and fabric.setup was called for a second one "
            f"({type(module).__name__} after {type(current).__name__}): the first model's state would be dropped. "
            "Set the models up as one module (e.g. torch.nn.ModuleDict({'generator': g, 'discriminator': d}), whose "
            "forward runs them) with fabric.setup_module, and their optimizers with fabric.setup_optimizers."
        )


class QCommFabricStrategy(ParallelStrategy):
    """Put before Fabric's strategy class in the bases (``class X(QCommFabricStrategy, DDPStrategy)``): its
    methods run first and hand on to that class's."""

    checkpoint_key: str
    presets: Presets
    _background: BackgroundComm | None = None

    def config_fingerprint(self) -> dict[str, Any]:
        """Everything that decides what the collectives send (compared across ranks at setup)."""
        raise NotImplementedError

    def checkpoint_entry(self, state: dict[str, Any]) -> tuple[dict[str, Any] | None, Any]:
        """Collective, at ``fabric.save``: (what to store under ``checkpoint_key``, this rank's own entry for its
        side file); None for either: nothing."""
        return None, None

    def restore_entry(self, entry: dict[str, Any] | None, state: dict[str, Any], own: Any = None) -> None:
        """At ``fabric.load``, after Fabric restored ``state``: the stored entry (None if the file has none) and
        this rank's side-file entry (None: none, or written by another number of ranks)."""

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_gloo_group_at_exit()  # a finished rank must not abort in interpreter teardown
        check_same_config(type(self).__name__, self.config_fingerprint(), timeout=presence_timeout(self._timeout))

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        entry, own = self.checkpoint_entry(state)  # every rank saves: collectives are fine here
        state = dict(state)
        if entry is not None:
            state[self.checkpoint_key] = entry
        if own is not None:
            rank_files.stash(state, self.checkpoint_key, own)
        write = super().save_checkpoint
        rank_files.save(self, state, path, lambda: write(path, state, storage_options=storage_options, filter=filter))

    @override
    def load_checkpoint(
        self, path: _PATH, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        remainder = super().load_checkpoint(path, state=state, strict=strict, weights_only=weights_only)
        if isinstance(state, dict) and state:  # else the raw checkpoint was asked for: leave it whole
            rank_files.load(self, remainder, path)
            own = rank_files.own_entry(remainder, self.checkpoint_key)
            remainder.pop(rank_files.RANK_STATE_KEY, None)
            remainder.pop(rank_files.MANIFEST_KEY, None)
            self.restore_entry(remainder.pop(self.checkpoint_key, None), state, own)
        return remainder

    @override
    def teardown(self) -> None:
        if self._background is not None:
            self._background.close()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register the family's names (``strategies.presets``, the Trainer's table) in Fabric's registry."""
        register_presets(strategy_registry, cls, cls.presets)


__all__ = ["QCommFabricStrategy", "check_fabric_ddp_kwargs", "check_one_module", "config_from"]
