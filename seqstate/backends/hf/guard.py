"""Activation hooks never poison the store: compute on a hooked model is refused unless the
store is frozen.

A torch forward hook or pre-hook may edit activations (steering, patching, ablation).  The KV
such a forward computes would be stored under plain tokens and silently reused by later clean
calls.  `HookGuard.check` runs before every forward of the HF engine: while any module of the
model, or torch's global registry, has a forward hook or pre-hook and no
``model.frozen_store()`` block is open, it raises `seqstate.ActivationHookError` before any
compute.  Inside ``frozen_store()`` stored KV is read and what is computed is scratch
(`seqstate.radix`), so hooks are allowed there.

Cost: the hook dictionaries of every module are listed once per call admission (which also
picks up modules added since), and each forward only tests them for emptiness.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.modules import module as torch_module

from seqstate.errors import ActivationHookError

__all__ = ["HookGuard", "GLOBAL_HOOKS"]

# torch's process-wide forward hooks (``nn.modules.module.register_module_forward_hook`` and
# ``..._forward_pre_hook``), mutated in place by torch.  The other global dictionaries are
# subsets of these (``_global_forward_hooks_always_called``, ``..._with_kwargs``: flags keyed
# by the same ids) or do not run in a forward (backward and registration hooks).
GLOBAL_HOOKS = (torch_module._global_forward_hooks, torch_module._global_forward_pre_hooks)


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
        self.rescan()

    def rescan(self) -> None:
        """List the hook dictionaries of every submodule (modules may have been added)."""
        self._dicts = [d for m in self.module.modules()
                       for d in (m._forward_hooks, m._forward_pre_hooks)]

    def check(self, *, rescan: bool = False) -> None:
        """Raise `ActivationHookError` when hooks are registered and the store is not frozen.

        ``rescan`` lists the submodules again first (once per call admission; each forward
        checks the list made then).
        """
        if self.store.frozen:
            return
        if rescan:
            self.rescan()
        if any(self._dicts) or any(GLOBAL_HOOKS):
            raise self._error()

    def hooks(self) -> dict[str, int]:
        """Forward hooks and pre-hooks per hooked module's name (``"<global>"``: torch's)."""
        found = {name or "<model>": len(m._forward_hooks) + len(m._forward_pre_hooks)
                 for name, m in self.module.named_modules()}
        found["<global>"] = sum(map(len, GLOBAL_HOOKS))
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
