"""Activation hooks never poison the store: compute on a hooked model is refused unless the
store is frozen.

A torch forward hook or pre-hook may edit activations (steering, patching, ablation).  The KV
such a forward computes would be stored under plain tokens and silently reused by later clean
calls.  `HookGuard.check` runs before every forward of the HF engine: while any module of the
model, or torch's global registry, has a forward hook or pre-hook and no
``model.frozen_store()`` block is open, it raises `seqstate.ActivationHookError` before any
compute.  Inside ``frozen_store()`` stored KV is read and what is computed is scratch
(`seqstate.radix`), so hooks are allowed there.

Two kinds of hooks change nothing the store keeps, and pass: transformers' output recorders
(one call with ``output_hidden_states=True`` or ``output_attentions=True`` leaves a forward
hook on every decoder layer and attention module, for good; each appends what it sees to a
collector only while such a call runs, and returns nothing), and seqstate's own hooks of a
hooked run (`seqstate.backends.hf.hooked`: they act on that run's forward only, whose KV is
never stored), marked with `SCRATCH_HOOK`.

Cost: the hook dictionaries of every module are listed once per call admission (which also
picks up modules added since), and each forward only tests them for emptiness.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.modules import module as torch_module

from seqstate.errors import ActivationHookError

__all__ = ["HookGuard", "GLOBAL_HOOKS", "SCRATCH_HOOK", "passes"]

# torch's process-wide forward hooks (``nn.modules.module.register_module_forward_hook`` and
# ``..._forward_pre_hook``), mutated in place by torch.  The other global dictionaries are
# subsets of these (``_global_forward_hooks_always_called``, ``..._with_kwargs``: flags keyed
# by the same ids) or do not run in a forward (backward and registration hooks).
GLOBAL_HOOKS = (torch_module._global_forward_hooks, torch_module._global_forward_pre_hooks)

# the attribute that marks a hook as seqstate's own, on a run that stores nothing
SCRATCH_HOOK = "_seqstate_scratch"

# transformers' output recorder: `install_output_capuring_hook`'s inner function (it records
# into the active collector, never returns a value)
_RECORDER = ("transformers.utils.output_capturing", "output_capturing_hook")


def passes(hook: Any) -> bool:
    """Whether ``hook`` cannot change what the store keeps: transformers' output recorder, or
    seqstate's own hook of a hooked run."""
    return (getattr(hook, SCRATCH_HOOK, False)
            or (getattr(hook, "__module__", None), getattr(hook, "__name__", None)) == _RECORDER)


class HookGuard:
    """Refuses compute while ``module`` has forward (pre-)hooks and ``store`` is not frozen.

    Parameters
    ----------
    module : torch.nn.Module
        The model whose submodules are watched.
    store : seqstate.backends.hf.store.KVStore
        Its store; ``store.frozen`` allows hooks.

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> hook = model.hf_model.model.layers[0].register_forward_hook(lambda m, a, out: None)
    >>> try:
    ...     model.backend.guard.check(rescan=True)
    ... except ss.ActivationHookError as exc:
    ...     print(exc.hooks)
    {'model.layers.0': 1}
    >>> with model.frozen_store():
    ...     model.backend.guard.check(rescan=True)          # allowed: nothing is stored
    >>> hook.remove()
    """

    def __init__(self, module: nn.Module, store: Any) -> None:
        self.module = module
        self.store = store
        self._dicts: list[dict] = []
        self._passing: list[tuple[dict, int]] = []
        self.rescan()

    def rescan(self) -> None:
        """List the hook dictionaries of every submodule (modules may have been added):
        those holding hooks that pass (`passes`) apart, with their sizes."""
        dicts = [d for m in self.module.modules() for d in (m._forward_hooks, m._forward_pre_hooks)]
        self._dicts = [d for d in dicts if not d or not all(map(passes, d.values()))]
        self._passing = [(d, len(d)) for d in dicts if d and all(map(passes, d.values()))]

    def check(self, *, rescan: bool = False) -> None:
        """Raise `ActivationHookError` when hooks are registered and the store is not frozen.

        ``rescan`` lists the submodules again first (once per call admission; each forward
        checks the list made then).
        """
        if self.store.frozen:
            return
        if rescan:
            self.rescan()
        if (any(self._dicts) or any(GLOBAL_HOOKS)
                or any(len(d) != n for d, n in self._passing)):
            if self.hooks():
                raise self._error()
            self.rescan()         # only hooks that pass, some added since: list them apart

    def hooks(self) -> dict[str, int]:
        """Forward hooks and pre-hooks per hooked module's name (``"<global>"``: torch's),
        those that pass (`passes`: transformers' recorders, seqstate's own) not counted."""
        found = {name or "<model>": _count(m._forward_hooks) + _count(m._forward_pre_hooks)
                 for name, m in self.module.named_modules()}
        found["<global>"] = sum(map(_count, GLOBAL_HOOKS))
        return {name: n for name, n in found.items() if n}

    def _error(self) -> ActivationHookError:
        found = self.hooks()
        where = ", ".join(f"{n} on {name!r}" if name != "<global>" else
                          f"{n} registered globally with torch.nn.modules.module."
                          f"register_module_forward_(pre_)hook" for name, n in found.items())
        return ActivationHookError(
            f"the model has torch forward hooks or pre-hooks ({where}); the KV computed "
            f"through them would be stored under plain tokens and reused by later calls "
            f"without the hooks.  Run hooked calls inside `with model.frozen_store(): ...` "
            f"(stored KV is read, the KV they compute is scratch, never stored), or remove "
            f"the hooks (`handle.remove()`) first", found)


def _count(hooks: dict) -> int:
    """The hooks of ``hooks`` that do not pass."""
    return sum(not passes(h) for h in hooks.values()) if hooks else 0
