"""Activation names of a transformers causal LM: TransformerLens-style names and module paths.

A `HookPoint` says where an activation lives in the HF module tree: a module's output or
the first input of a module (its ``hidden_states``), optionally viewed as ``(..., heads,
head_dim)``, or an attention module's weights (``attn.hook_pattern``, read only).  Two kinds
of names resolve to one:

* TransformerLens's names, where the model's decoder layers map onto TransformerLens's block
  cleanly: a decoder layer with ``self_attn.o_proj`` and a gated MLP (``gate_proj``,
  ``up_proj``, ``down_proj``): Llama (SmolLM2), Mistral, Qwen2, Gemma 3.  Gemma's sandwich
  norms are read as TransformerLens reads them: ``hook_attn_out`` and ``hook_mlp_out`` are
  what is added to the residual stream, after the post-norms.
* A module path of ``model.hf_model`` (``"model.layers.3.mlp"``): that module's output (the
  first element where it returns a tuple).

Names that resolve to nothing raise `seqstate.HookNameError` listing the forms this model
accepts, before any compute.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from torch import nn

from seqstate.errors import HookNameError

__all__ = ["HookPoint", "resolve", "block_names"]

_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")


@dataclasses.dataclass(frozen=True, slots=True)
class HookPoint:
    """Where a named activation is: ``module``'s output (``input=False``) or the first input
    of ``module`` (``input=True``), viewed as ``(..., heads, head_dim)`` where ``heads``;
    ``pattern``: the attention weights ``module`` (an attention layer) returns beside its
    output, which only eager attention forms (read only)."""

    name: str
    module: nn.Module
    input: bool = False
    heads: int | None = None
    pattern: bool = False


def _layers(hf_model: Any) -> Sequence[nn.Module] | None:
    layers = getattr(hf_model.get_decoder(), "layers", None)
    return layers if isinstance(layers, nn.ModuleList) else None


def _sandwich(layer: nn.Module) -> bool:
    """Gemma's layout: a norm after the attention and after the MLP, before the residual add."""
    return hasattr(layer, "pre_feedforward_layernorm") and hasattr(layer, "post_feedforward_layernorm")


def _block_points(layer: nn.Module, heads: int, kv_heads: int) -> dict[str, tuple]:
    """Every TransformerLens block hook name, in TransformerLens's order (the one list of
    them), with its ``(module, input, heads[, pattern])`` inside one decoder layer; the module
    is None where this layer has no clean counterpart."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    sandwich = _sandwich(layer)
    plain_qk = attn is not None and not hasattr(attn, "q_norm")     # no norm after q_proj
    return {
        "hook_resid_pre": (layer, True, None),
        "hook_resid_post": (layer, False, None),
        "ln1.hook_normalized": (getattr(layer, "input_layernorm", None), False, None),
        "ln2.hook_normalized": (getattr(layer, "pre_feedforward_layernorm" if sandwich
                                        else "post_attention_layernorm", None), False, None),
        "hook_attn_out": ((getattr(layer, "post_attention_layernorm", None) if sandwich
                           else attn), False, None),
        "attn.hook_z": (getattr(attn, "o_proj", None), True, heads),
        "attn.hook_pattern": (attn, False, None, True),
        "attn.hook_q": (getattr(attn, "q_proj", None) if plain_qk else None, False, heads),
        "attn.hook_k": (getattr(attn, "k_proj", None) if plain_qk else None, False, kv_heads),
        "attn.hook_v": (getattr(attn, "v_proj", None) if plain_qk else None, False, kv_heads),
        "mlp.hook_pre": (getattr(mlp, "gate_proj", None), False, None),
        "mlp.hook_pre_linear": (getattr(mlp, "up_proj", None), False, None),
        "mlp.hook_post": (getattr(mlp, "down_proj", None), True, None),
        "hook_mlp_out": ((getattr(layer, "post_feedforward_layernorm", None) if sandwich
                          else mlp), False, None),
    }


def _block_point(layer: nn.Module, hook: str, heads: int, kv_heads: int) -> tuple | None:
    """``(module, input, heads[, pattern])`` of TransformerLens's ``hook`` inside one decoder
    layer, or None where this layer has no clean counterpart."""
    found = _block_points(layer, heads, kv_heads).get(hook)
    return found if found is not None and found[0] is not None else None


def block_names(hf_model: Any) -> list[str]:
    """The TransformerLens-style hooks of a block this model maps (``"hook_resid_pre"``, ...)."""
    layers = _layers(hf_model)
    if not layers:
        return []
    heads = hf_model.config.get_text_config(decoder=True).num_attention_heads
    return [h for h, found in _block_points(layers[0], heads, heads).items()
            if found[0] is not None]


def resolve(hf_model: Any, name: str) -> HookPoint:
    """The `HookPoint` of ``name`` on ``hf_model``; `HookNameError` listing the accepted
    forms when there is none.

    Examples
    --------
    >>> import seqstate as ss
    >>> hf = ss.models.testing.tiny().hf_model
    >>> point = resolve(hf, "blocks.1.attn.hook_z")
    >>> o_proj = hf.model.layers[1].self_attn.o_proj
    >>> point.module is o_proj, point.input, point.heads
    (True, True, 4)
    >>> resolve(hf, "model.layers.0.mlp").module is hf.model.layers[0].mlp
    True
    """
    if not isinstance(name, str):
        raise HookNameError(f"an activation name is a str, got {name!r}; {_forms(hf_model)}")
    cfg = hf_model.config.get_text_config(decoder=True)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    layers = _layers(hf_model)
    if name == "ln_final.hook_normalized" and layers:
        norm = getattr(hf_model.get_decoder(), "norm", None)
        if norm is not None:
            return HookPoint(name, norm)
    match = _BLOCK.fullmatch(name)
    if match and layers:
        index, hook = int(match.group(1)), match.group(2)
        if index >= len(layers):
            raise HookNameError(f"{name!r} names block {index}, but {_model(hf_model)} has "
                                f"{len(layers)} blocks (0..{len(layers) - 1}); "
                                f"{_forms(hf_model)}")
        found = _block_point(layers[index], hook, heads, kv_heads)
        if found is not None:
            return HookPoint(name, *found)
    if not name.startswith("blocks."):
        try:
            module = hf_model.get_submodule(name)
        except AttributeError:
            module = None
        if module is not None and module is not hf_model:
            return HookPoint(name, module)
    raise HookNameError(f"{name!r} names no activation of {_model(hf_model)}; "
                        f"{_forms(hf_model)}")


def _model(hf_model: Any) -> str:
    return f"this {type(hf_model).__name__}"


def _forms(hf_model: Any) -> str:
    """The accepted forms, for error messages."""
    layers = _layers(hf_model)
    paths = [n for n, _ in hf_model.named_modules() if n][:3]
    tail = (f"or a module path of model.hf_model (its output), such as "
            f"{', '.join(repr(p) for p in paths)}, ... (model.hf_model.named_modules())")
    if not layers:
        return f"TransformerLens-style names are not mapped for this model: give {tail}"
    hooks = block_names(hf_model)
    return (f"give a TransformerLens-style name, blocks.{{i}}.HOOK with i in "
            f"0..{len(layers) - 1} and HOOK one of {', '.join(hooks)}; "
            f"ln_final.hook_normalized; {tail}")
