"""Activations on states (seqstate/activations.py, seqstate/backends/hf/hooked.py and
hook_points.py): cached activations against a fresh full forward's, read by hand-written
torch hooks; patched log-probs against a patched full-sequence forward; the store untouched
by any hooked run; names, prefix positions and other engines refused with typed errors."""

import pytest
import torch

import seqstate as ss
from conftest import assert_close, verify_store

STORY = ("When Mary and John went to the store, they talked about the weather for a long "
         "while, and then")


@pytest.fixture(scope="module")
def tiny():
    """A tiny model of this module's own (the recorder test adds transformers' hooks)."""
    return ss.models.testing.tiny(seed=5)


def _states(model):
    """A stored prefix, and a clean and a corrupt variant after it (same lengths)."""
    story = ss.from_tokens(model, [model.encode_prompt(STORY)])
    story.next_logprobs()                              # stores the prefix's KV
    clean, corrupt = story + " John gave a drink to", story + " Mary gave a drink to"
    assert len(clean.rows[0].tokens) == len(corrupt.rows[0].tokens)
    return story, clean, corrupt


def _fresh(model, tokens, layers, patch=None):
    """A fresh forward over ``tokens`` (no cache): each decoder layer's input and output, by
    hand-written hooks; ``patch(layer, hidden) -> hidden`` edits a layer's input.  Returns
    (inputs, outputs, log-softmax (T, V))."""
    decoder = model.hf_model.get_decoder().layers
    ins, outs, handles = {}, {}, []
    for i in layers:
        def pre(module, args, kwargs, i=i):
            hidden = args[0] if args else kwargs["hidden_states"]
            if patch is not None:
                hidden = patch(i, hidden.clone())
            ins[i] = hidden.clone()
            return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs,
                                                                        "hidden_states": hidden})

        def post(module, args, output, i=i):
            outs[i] = (output[0] if isinstance(output, tuple) else output).clone()
        handles += [decoder[i].register_forward_pre_hook(pre, with_kwargs=True),
                    decoder[i].register_forward_hook(post)]
    try:
        with torch.inference_mode():
            logits = model.hf_model(input_ids=torch.tensor([list(tokens)]), use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    return ins, outs, logits[0].float().log_softmax(-1)


@pytest.mark.parametrize("which", ["tiny", pytest.param("real", marks=pytest.mark.real),
                                   pytest.param("gemma", marks=pytest.mark.real)])
def test_cached_activations_equal_a_fresh_forward(which, request):
    model = request.getfixturevalue(which)
    last = model.num_layers - 1
    story, clean, _ = _states(model)
    names = [f"blocks.{i}.{h}" for i in (0, last) for h in
             ("hook_resid_pre", "hook_resid_post", "hook_attn_out", "hook_mlp_out",
              "attn.hook_z", "mlp.hook_post")] + [f"model.layers.{last}"]
    before = model.stats
    cache = clean.run_with_cache(names)
    n, k = len(clean.rows[0].tokens), len(story.rows[0].tokens)
    assert cache.positions.computed == (k,) and cache.positions.tensor.tolist() == [
        list(range(k, n))]
    assert (model.stats - before).prefill_tokens == n - k      # the story was read, not fed
    ins, outs, fresh = _fresh(model, clean.rows[0].tokens, (0, last))
    for i in (0, last):
        assert_close(cache[f"blocks.{i}.hook_resid_pre"][0], ins[i][0, k:], model,
                     "activations: resid_pre")
        assert_close(cache[f"blocks.{i}.hook_resid_post"][0], outs[i][0, k:], model,
                     "activations: resid_post")
        # TransformerLens's block: what attention and the MLP add to the residual stream
        added = cache[f"blocks.{i}.hook_attn_out"] + cache[f"blocks.{i}.hook_mlp_out"]
        assert_close(added[0], (outs[i] - ins[i])[0, k:], model, "activations: attn+mlp out")
        layer = model.hf_model.get_decoder().layers[i]
        z = cache[f"blocks.{i}.attn.hook_z"]
        assert z.shape[-2:] == (model.hf_model.config.num_attention_heads, model.head_dim)
        post = cache[f"blocks.{i}.mlp.hook_post"]
        with torch.inference_mode():
            attn, mlp = layer.self_attn.o_proj(z.flatten(-2)), layer.mlp.down_proj(post)
            if hasattr(layer, "post_feedforward_layernorm"):          # Gemma's sandwich
                attn = layer.post_attention_layernorm(attn)
                mlp = layer.post_feedforward_layernorm(mlp)
        assert_close(attn, cache[f"blocks.{i}.hook_attn_out"], model, "activations: hook_z")
        assert_close(mlp, cache[f"blocks.{i}.hook_mlp_out"], model, "activations: mlp.hook_post")
    assert torch.equal(cache[f"model.layers.{last}"], cache[f"blocks.{last}.hook_resid_post"])
    assert_close(cache.logprobs[0, 0], fresh[-1], model, "activations: cache log-probs")


@pytest.mark.parametrize("which", ["tiny", pytest.param("real", marks=pytest.mark.real),
                                   pytest.param("gemma", marks=pytest.mark.real)])
def test_attention_patterns_equal_a_fresh_eager_forward(which, request):
    model = request.getfixturevalue(which)
    hf, last = model.hf_model, model.num_layers - 1
    story, clean, _ = _states(model)
    implementation = hf.config._attn_implementation
    names = [f"blocks.{i}.attn.hook_pattern" for i in (0, last)]
    cache = clean.run_with_cache(names)
    assert hf.config._attn_implementation == implementation          # eager for that run only
    n, k = len(clean.rows[0].tokens), len(story.rows[0].tokens)
    hf.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            fresh = hf(input_ids=torch.tensor([list(clean.rows[0].tokens)]), use_cache=False,
                       output_attentions=True).attentions
    finally:
        hf.set_attn_implementation(implementation)
    heads = hf.config.get_text_config(decoder=True).num_attention_heads
    for i in (0, last):
        got = cache[f"blocks.{i}.attn.hook_pattern"]            # (rows, columns, heads, keys)
        assert got.shape == (1, n - k, heads, n)
        want = fresh[i][0, :, k:].transpose(0, 1)                   # (columns, heads, keys)
        assert_close(got[0], want, model, "activations: attention pattern")
        assert_close(got.sum(-1), torch.ones(got.shape[:-1]), model, "activations: weights sum")
        assert cache.at(names[0], -1).shape == (1, heads, n)


def test_start_0_recomputes_every_position(tiny):
    _, clean, _ = _states(tiny)
    before = tiny.stats
    cache = clean.run_with_cache(["blocks.1.hook_resid_pre"], start=0)
    n = len(clean.rows[0].tokens)
    assert cache.positions.computed == (0,) and (tiny.stats - before).prefill_tokens == n
    ins, _, _ = _fresh(tiny, clean.rows[0].tokens, (1,))
    assert_close(cache["blocks.1.hook_resid_pre"][0], ins[1][0], tiny, "activations: start=0")
    assert_close(cache.at("blocks.1.hook_resid_pre", 3), ins[1][:, 3], tiny,
                 "activations: at(3)")


@pytest.mark.parametrize("which", ["tiny", pytest.param("real", marks=pytest.mark.real),
                                   pytest.param("gemma", marks=pytest.mark.real)])
def test_a_patched_run_equals_a_patched_full_forward(which, request):
    model = request.getfixturevalue(which)
    story, clean, corrupt = _states(model)
    layer, at = model.num_layers // 3, len(story.rows[0].tokens)       # the name
    name = f"blocks.{layer}.hook_resid_pre"
    clean_cache = clean.run_with_cache([name])

    def patch(act, pos):
        act[pos.at(at)] = clean_cache.at(name, at)

    def by_hand(i, hidden):
        if i == layer:
            hidden[:, at] = clean_cache.at(name, at)
        return hidden

    got = corrupt.with_hooks({name: patch}).next_logprobs()
    assert torch.equal(got, corrupt.next_logprobs(hooks={name: patch}))
    _, _, want = _fresh(model, corrupt.rows[0].tokens, (layer,), by_hand)
    assert_close(got[0, 0], want[-1], model, "activations: patched next log-probs")
    assert (got - corrupt.next_logprobs()).abs().max() > 1e-3      # the patch changed them
    # scored continuations, hooked: each pair a row of the forward
    options = [" Mary", " the cat"]
    sc = corrupt.with_hooks({name: patch}, start=at).score(options)   # its KV is stored now
    for j, option in enumerate(options):
        ids = model.encode(option)
        _, _, want = _fresh(model, list(corrupt.rows[0].tokens) + ids[:-1], (layer,), by_hand)
        rows = want[len(corrupt.rows[0].tokens) - 1:]
        expected = rows.gather(1, torch.tensor(ids)[:, None])[:, 0]
        assert_close(torch.tensor(sc.logprobs[0][0][j]), expected, model,
                     "activations: patched scores")


def test_hooks_may_return_a_replacement_and_see_heads(tiny):
    _, clean, _ = _states(tiny)
    seen = []

    def scale(act, pos):
        seen.append((tuple(act.shape), pos.tensor.shape))
        return act * 0.5

    name = "blocks.0.attn.hook_z"
    hooked = clean.with_hooks({name: scale}).run_with_cache([name, "blocks.0.hook_attn_out"])
    plain = clean.run_with_cache([name])
    assert_close(hooked[name], plain[name] * 0.5, tiny, "activations: returned patch")
    assert seen[0][0][-2:] == (4, tiny.head_dim) and seen[0][0][:2] == tuple(seen[0][1])
    with pytest.raises(ValueError, match="same shape"):
        clean.next_logprobs(hooks={name: lambda act, pos: act[..., :1]})


def test_clean_calls_give_what_they_gave_after_any_hooked_run(fresh_tiny):
    model = fresh_tiny
    story, clean, corrupt = _states(model)
    lp, sc = corrupt.next_logprobs(), corrupt.score([" Mary", " the cat"])
    cached, segments = model.stats.kv_bytes_cached, model.stats.segments
    zero = {"blocks.0.hook_resid_post": lambda act, pos: act.zero_(),
            "blocks.1.mlp.hook_post": lambda act, pos: act + 1}
    corrupt.with_hooks(zero).next_logprobs()
    corrupt.with_hooks(zero, start=0).score([" Mary"])
    clean.with_hooks(zero).run_with_cache(["blocks.1.hook_resid_pre",
                                               "blocks.1.attn.hook_pattern"])
    (clean + " more").next_logprobs(hooks=zero)              # tokens the store has never seen
    assert model.stats.kv_bytes_cached == cached and model.stats.segments == segments
    verify_store(model)
    assert torch.equal(corrupt.next_logprobs(), lp)
    assert corrupt.score([" Mary", " the cat"]).logprobs == sc.logprobs
    assert not model.hf_model.model.layers[0]._forward_hooks        # the hooks went


def test_a_position_of_the_stored_prefix_is_refused(tiny):
    story, clean, _ = _states(tiny)
    k = len(story.rows[0].tokens)

    def early(act, pos):
        act[pos.at(2)] = 0

    with pytest.raises(ss.PrefixPositionError, match=rf"start=2.*start=0.*full forward") as info:
        clean.with_hooks({"blocks.0.hook_resid_pre": early}).next_logprobs()
    assert f"0..{k - 1} were read from the store" in str(info.value)
    assert isinstance(info.value, IndexError)
    patched = clean.with_hooks({"blocks.0.hook_resid_pre": early}, start=2).next_logprobs()
    assert patched.shape == (1, 1, tiny.vocab.size) or patched.shape[:2] == (1, 1)
    with pytest.raises(ss.PrefixPositionError, match="start="):
        clean.run_with_cache(["blocks.0.hook_resid_pre"]).at("blocks.0.hook_resid_pre", 0)


def test_a_position_past_a_row_s_end_is_an_argument_error(tiny):
    """Not a stored-prefix error: the message names the row's positions."""
    prompt = ss.from_tokens(tiny, [list(range(100, 112))])
    run = prompt.with_hooks({}, start=0).run_with_cache(["blocks.0.hook_resid_pre"])
    for position in (12, -13):
        with pytest.raises(ss.ArgumentError, match=rf"position {position} is past the end "
                                                   r"of row 0, whose positions are 0\.\.11 "
                                                   r"\(-12\.\.-1 from its end\)"):
            run.at("blocks.0.hook_resid_pre", position)
    with pytest.raises(ss.ArgumentError, match="2 positions for 1 rows"):
        run.positions.at([0, 1])
    assert run.at("blocks.0.hook_resid_pre", -12).shape == run.at(
        "blocks.0.hook_resid_pre", 0).shape


def test_a_stored_baseline_says_why_its_positions_are_out_of_reach(tiny):
    def early(act, pos):
        act[pos.at(3)] = 0

    prompt = ss.from_tokens(tiny, [list(range(100, 112))])
    # the tutorial's baseline stores nothing: a later hook still reaches every position
    base = prompt.with_hooks({}).next_logprobs()
    prompt.with_hooks({"blocks.0.hook_resid_pre": early}).next_logprobs()
    # the obvious baseline stores the prompt, and the message says so
    stored = ss.from_tokens(tiny, [list(range(200, 212))])
    stored.next_logprobs()
    with pytest.raises(ss.PrefixPositionError, match=r"an earlier call on these tokens stored "
                       r"them.*state\.next_logprobs\(\); take a baseline that stores "
                       r"nothing with state\.with_hooks\(\{\}\)\.next_logprobs\(\)"):
        stored.with_hooks({"blocks.0.hook_resid_pre": early}).next_logprobs()
    assert base.shape == prompt.next_logprobs().shape


def test_unknown_names_are_refused_before_compute_listing_the_forms(tiny):
    _, clean, _ = _states(tiny)
    before = tiny.stats
    for name, why in [("blocks.0.hook_resid_mid", "names no activation"),
                      ("blocks.7.hook_resid_pre", "has 2 blocks"),
                      ("model.layers.9", "names no activation")]:
        with pytest.raises(ss.HookNameError, match=why) as info:
            clean.run_with_cache([name])
        assert "blocks.{i}.HOOK" in str(info.value) and "hook_resid_post" in str(info.value)
        assert "model.layers" in str(info.value) and isinstance(info.value, KeyError)
    with pytest.raises(ss.HookNameError):
        clean.with_hooks({"nope": lambda a, p: None}).next_logprobs()
    with pytest.raises(ss.ArgumentError):
        clean.with_hooks({"blocks.0.hook_resid_pre": 3}).next_logprobs()
    with pytest.raises(ss.ArgumentError):
        clean.score([" a"], store=True, hooks={})
    with pytest.raises(ss.ArgumentError, match="read only.*attn.hook_z"):
        clean.next_logprobs(hooks={"blocks.0.attn.hook_pattern": lambda a, p: None})
    assert tiny.stats == before
    with pytest.raises(ss.HookNameError, match="holds"):
        clean.run_with_cache(["blocks.0.hook_resid_pre"])["blocks.1.hook_resid_pre"]


def test_transformers_output_recorders_do_not_trip_the_guard(tiny):
    """transformers 5.x leaves an output-recording hook on every decoder layer and attention
    module after one ``output_hidden_states=True`` call; they record and never edit."""
    state = ss.from_tokens(tiny, [tiny.encode_prompt("Recorders record")])
    with torch.inference_mode():
        tiny.hf_model(input_ids=torch.tensor([tiny.encode_prompt("Hi there")]),
                      output_hidden_states=True)
    recorded = [n for n, m in tiny.hf_model.named_modules() if m._forward_hooks]
    assert "model.layers.0" in recorded and "model.layers.0.self_attn" in recorded
    lp = state.next_logprobs()                      # not refused: the recorders pass
    assert_close(lp[0, 0], tiny.full_logits(state.rows[0].tokens)[-1].log_softmax(-1), tiny,
                 "activations: beside transformers' recorders")
    handle = tiny.hf_model.model.layers[1].register_forward_hook(lambda m, a, out: out * 2)
    try:
        with pytest.raises(ss.ActivationHookError) as info:
            (state + " again").next_logprobs()
        assert info.value.hooks == {"model.layers.1": 1}     # the user's hook only
    finally:
        handle.remove()
    (state + " again").next_logprobs()


@pytest.mark.llamacpp
def test_llamacpp_refuses_before_compute(llama):
    state = ss.from_tokens(llama, [llama.encode_prompt("Hello there")])
    before = llama.stats
    for call in (lambda: state.run_with_cache(["blocks.0.hook_resid_pre"]),
                 lambda: state.with_hooks({"blocks.0.hook_resid_pre": print}).next_logprobs(),
                 lambda: state.score([" a"], hooks={})):
        with pytest.raises(ss.CapabilityError, match="activations") as info:
            call()
        assert info.value.engine == "llama.cpp" and info.value.capability == "activations"
    assert llama.stats == before


def test_vllm_refuses_before_any_request(tiny, monkeypatch):
    """The vLLM engine's backend on a URL where no server listens: a request would raise
    `EngineError`; the capability is refused first."""
    from seqstate.backends.vllm.backend import VllmBackend
    from seqstate.backends.vllm.client import Client

    backend = VllmBackend(Client("http://127.0.0.1:9"), "m", tiny.vocab.size, "f", 2048)
    monkeypatch.setattr(tiny, "backend", backend)
    state = ss.from_tokens(tiny, [[1, 2, 3]])
    with pytest.raises(ss.CapabilityError, match="activations") as info:
        state.run_with_cache(["blocks.0.hook_resid_pre"])
    assert info.value.engine == "vllm"
    with pytest.raises(ss.CapabilityError):
        state.next_logprobs(hooks={"blocks.0.hook_resid_pre": print})
