"""`SeqStateLM`: an lm-evaluation-harness model that scores on shared prefixes.

lm-eval's own Hugging Face backend runs every (context, continuation) pair as its own padded
row; a 5-shot multiple-choice task feeds the few-shot prefix once per answer.  Here the
requests are grouped by context: one state row per distinct context and one
`SequenceState.score` call over them, so each prefix is computed once and stored, and the
answers are teacher-forced behind it.  Tokenisation follows lm-eval's HF backend exactly
(`TemplateLM._encode_pair`, the prefix token for an empty context, left truncation), so the
same `Instance` gives the same tokens, and log-likelihoods equal to fp32 noise.

Under a data-parallel launch (``torchrun --nproc_per_node N``, ``accelerate launch``) each
process is one rank: it builds its own model, lm-eval hands it its share of the instances,
and the ranks meet through torch.distributed (gloo on the CPU, NCCL on CUDA) to gather the
answers on rank 0, which alone writes the results.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

import lm_eval.models  # noqa: F401  (lm-eval's lazy model table, filled before ours joins it)
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (handle_stop_sequences, normalize_gen_kwargs,
                                  postprocess_generated_text)

import seqstate as ss
from seqstate.backends import registry
from seqstate.errors import ArgumentError, ContextOverflowError

__all__ = ["SeqStateLM"]

Pair = tuple[tuple[int, ...], tuple[int, ...]]


@register_model("seqstate")
class SeqStateLM(TemplateLM):
    """An lm-eval model (``--model seqstate``) running on a seqstate model.

    Parameters
    ----------
    model : seqstate model, optional
        A model you already have (``ss.models.default()``, ``ss.models.llamacpp(...)``, ...).
        Without it one is built from ``engine`` and ``path``.
    engine : str, default "hf"
        The engine of the model built when ``model`` is not given (``"hf"``, ``"llama.cpp"``
        or ``"vllm"``, `seqstate.backends.registry`).  ``vllm`` connects to a running server:
        ``url=`` (with ``api_key=`` and ``ca_certs=`` where it needs them, as
        `seqstate.models.vllm` takes them; ``api_key`` defaults to ``$SEQSTATE_VLLM_API_KEY``),
        and runs in the server's dtype, on the server's device.
    path : str, optional
        A local transformers directory or ``.gguf`` file (``pretrained`` is an alias, as in
        lm-eval's ``hf`` model); None: the default model (SmolLM2-135M-Instruct).
    dtype : str, default "float32"
        The torch dtype of a model built on the ``hf`` engine.
    max_length : int, optional
        The context window used for truncation and rolling windows; default the model's.
    add_bos_token, prefix_token_id : optional
        As lm-eval's ``hf`` model: force the tokenizer's special tokens on or off, and the
        token an empty context stands for (default BOS, else EOS).
    pairs_per_call : int, default 1024
        (context, continuation) pairs handed to one ``score`` call; memory is bounded by the
        engine's prefill budget whatever the value, this only sets how often the bar moves.
    concurrency : int, default 16
        ``generate_until`` requests in flight at once (`ss.run_batch`).
    seed : int, default 1234
        Seed of sampled generations (``do_sample=True``); greedy ones do not use it.
    device : str, optional
        Where a model built here runs on the ``hf`` engine (``"cpu"``, ``"cuda:0"``, ...); a
        device this machine lacks is refused (`seqstate.ArgumentError`) before any weight is
        read.  The ``llama.cpp`` engine takes only ``"cpu"``; ``vllm`` ignores it (the
        server's device).  With ``model=``, it must name
        the device that model is on.  ``seqstate-lm-eval`` passes ``cpu`` unless
        ``--device`` says otherwise (lm-eval's own default is ``cuda:0``).
        Under a data-parallel launch a CUDA device means each rank's own, ``cuda:LOCAL_RANK``.
    batch_size, max_batch_size :
        Accepted and ignored: lm-eval's command line always passes them, while the engine
        packs rows under its own token budget.
    **engine_options :
        Passed to the model loader (``n_ctx``, ``n_threads``, ``n_seq_max`` for llama.cpp;
        ``url``, ``api_key``, ``ca_certs``, ``timeout`` for vllm).

    Notes
    -----
    The rank and the number of processes come from the launcher's environment (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, as torchrun and ``accelerate launch`` set them); with
    ``WORLD_SIZE`` above 1 a process group is started unless one exists.  The ``vllm`` engine
    is refused there (`seqstate.ArgumentError`): one server already batches every client's
    requests, so more client processes add no device.

    Examples
    --------
    >>> import seqstate as ss
    >>> from lm_eval.api.instance import Instance
    >>> lm = SeqStateLM(model=ss.models.testing.tiny())
    >>> req = Instance("loglikelihood", {}, ("The sky is", " blue"), 0)
    >>> (logprob, is_greedy), = lm.loglikelihood([req], disable_tqdm=True)
    >>> logprob < 0
    True
    """

    def __init__(self, model: Any = None, *, engine: str = "hf", path: str | None = None,
                 pretrained: str | None = None, dtype: str = "float32",
                 max_length: int | None = None, add_bos_token: bool | None = None,
                 prefix_token_id: int | None = None, pairs_per_call: int = 1024,
                 concurrency: int = 16, seed: int = 1234, batch_size: Any = None,
                 max_batch_size: Any = None, device: str | None = None,
                 **engine_options: Any) -> None:
        super().__init__()
        if path is not None and pretrained is not None:
            raise ArgumentError("give the model's location once: path=... or pretrained=...")
        path = path if path is not None else pretrained
        rank, world_size, local_rank = _launch()
        if world_size > 1:
            if engine == "vllm" or getattr(model, "engine", None) == "vllm":
                raise ArgumentError(
                    f"a data-parallel launch (WORLD_SIZE={world_size}) of engine=vllm only adds "
                    "clients: the server already batches every client's requests, and one "
                    "process keeps it busy (raise concurrency=... for generation).  Run one "
                    "process; for more devices, serve more (vLLM's --data-parallel-size, or a "
                    "fleet behind a router)")
            device = _rank_device(device, local_rank)
        if model is None:
            model = _load(engine, path, dtype, device, engine_options)
        elif path is not None or engine_options:
            raise ArgumentError("model=... is a model already loaded; path, pretrained and "
                                f"engine options ({sorted(engine_options)}) build one: give "
                                "one or the other")
        else:
            _check_device(model, device)
        if not isinstance(pairs_per_call, int) or pairs_per_call < 1:
            raise ArgumentError(f"pairs_per_call must be an int >= 1, got {pairs_per_call!r}")
        self.model = model
        self.tokenizer = model.hf_tokenizer
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.pairs_per_call = pairs_per_call
        self.concurrency = concurrency
        self.seed = seed
        self._max_length = max_length
        self._rank, self._world_size, self._device = rank, world_size, model.device
        if world_size > 1:
            _join(rank, world_size, self._device)

    # -- data parallel: what lm-eval's evaluator calls when world_size > 1 --------------------
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated in rank order (a 0-d tensor counts as one
        element), as accelerate's ``gather``."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor)
        return torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on rank ``dst``; None on the others."""
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        """Wait for every rank."""
        if self.world_size > 1:
            dist.barrier()

    # -- what lm-eval asks of a model --------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_token_id
        return eos if eos is not None else min(self.model.eos_token_ids)

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        return self.model.start_token_ids[0]

    @property
    def max_length(self) -> int:
        return self._max_length or self.model.context_length

    @property
    def max_gen_toks(self) -> int:
        return 256

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path or self.model.name).replace("/", "__")

    def get_model_info(self) -> dict[str, Any]:
        return {"model_name": self.model.name, "engine": self.model.engine}

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **kwargs: Any) -> list[int]:
        """As lm-eval's HF model encodes: the tokenizer's own special tokens unless told,
        none when the text already starts with the prefix token."""
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token
        if add_special_tokens is None and string.startswith(
                self.tokenizer.decode(self.prefix_token_id)):
            add_special_tokens = False
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        ids = self.tokenizer.encode(string, **options)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # -- scoring -----------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs: Any
                              ) -> list[tuple[float, bool]]:
        pairs = [self._fit(context, continuation) for _, context, continuation in requests]
        by_context: dict[tuple[int, ...], list[int]] = {}
        for i, (context, continuation) in enumerate(pairs):
            if continuation:
                by_context.setdefault(context, []).append(i)
        results: list[tuple[float, bool]] = [(0.0, True)] * len(requests)   # empty answers
        with tqdm(total=len(requests), disable=disable_tqdm,
                  desc="Running loglikelihood requests") as bar:
            bar.update(len(requests) - sum(map(len, by_context.values())))
            # sorted contexts put shared prefixes side by side in each call
            for contexts in _chunks(sorted(by_context), by_context, self.pairs_per_call):
                state = ss.from_tokens(self.model, [list(c) for c in contexts])
                scores = state.score([[list(pairs[i][1]) for i in by_context[c]]
                                      for c in contexts])
                sums = scores.sums.tolist()                          # (contexts, 1, options)
                for b, context in enumerate(contexts):
                    for o, i in enumerate(by_context[context]):
                        results[i] = (sums[b][0][o], scores.greedy[b][0][o])
                        if requests[i][0] is not None:
                            self.cache_hook.add_partial("loglikelihood", requests[i][0],
                                                        results[i])
                    bar.update(len(by_context[context]))
        return results

    def _fit(self, context: list[int], continuation: list[int]) -> Pair:
        """lm-eval's left truncation: context and continuation in ``max_length + 1`` tokens."""
        if len(continuation) > self.max_length:
            raise ContextOverflowError(
                f"a continuation of {len(continuation)} tokens does not fit max_length "
                f"{self.max_length}; shorten it or raise max_length (model_args)")
        keep = self.max_length + 1 - len(continuation)
        return tuple(context[-keep:]), tuple(continuation)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False
                              ) -> list[float]:
        """Each text's log-likelihood over lm-eval's disjoint rolling windows."""
        windows, owner = [], []
        for k, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(lm_utils.make_disjoint_window,
                                             lm_utils.get_rolling_token_windows(
                                                 token_list=self.tok_encode(text),
                                                 prefix_token=self.prefix_token_id,
                                                 max_seq_len=self.max_length,
                                                 context_len=1)):
                windows.append((None, context, continuation))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[k] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation --------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each request's continuation, generated until a stop string or ``max_gen_toks``;
        greedy unless its ``do_sample`` is set.  The requests run concurrently (`run_batch`),
        sharing decode steps."""
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        jobs = list(enumerate(req.args for req in requests))
        texts = ss.run_batch(lambda job: self._generate(job[0], *job[1], eos=eos), jobs,
                             concurrency=self.concurrency, progress=not disable_tqdm,
                             return_exceptions=False)
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts

    def _generate(self, index: int, context: str, gen_kwargs: dict[str, Any], *,
                  eos: str) -> str:
        options = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
        until = handle_stop_sequences(options.pop("until", None), eos=eos)
        max_gen_toks = options.pop("max_gen_toks")
        room = self.max_length - max_gen_toks
        if room <= 0:
            raise ContextOverflowError(f"max_gen_toks {max_gen_toks} leaves no room for a "
                                       f"context in max_length {self.max_length}")
        ids = self.tok_encode(context, left_truncate_len=room) or [self.prefix_token_id]
        sampler = ss.greedy()
        if options.get("do_sample"):
            sampler = ss.multinomial(temperature=float(options.get("temperature") or 1.0),
                                     top_k=options.get("top_k"), top_p=options.get("top_p"))
        state = ss.text(self.model)(ss.from_tokens(self.model, [ids]), max_tokens=max_gen_toks,
                                    stop_at=[s for s in until if s] or None, sampler=sampler,
                                    seed=self.seed + index if options.get("do_sample") else None)
        new = state.token_ids[0][0][len(ids):]
        return postprocess_generated_text(self.tok_decode(new), stop=until, think_end_token=None)


def _chunks(contexts: list[tuple[int, ...]], by_context: dict[tuple[int, ...], list[int]],
            pairs: int) -> Iterator[list[tuple[int, ...]]]:
    """Consecutive runs of contexts holding about ``pairs`` pairs each."""
    run: list[tuple[int, ...]] = []
    count = 0
    for context in contexts:
        run.append(context)
        count += len(by_context[context])
        if count >= pairs:
            yield run
            run, count = [], 0
    if run:
        yield run


def _launch() -> tuple[int, int, int]:
    """This process's ``(rank, world size, local rank)`` from the launcher's environment
    (torchrun, ``accelerate launch``); ``(0, 1, 0)`` without one.  Checked before any model
    is built: a process group about to start needs ``MASTER_ADDR`` and ``MASTER_PORT``."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    try:
        rank, world_size, local_rank = (int(os.environ.get(n, d)) for n, d in
                                        zip(names, ("0", "1", os.environ.get("RANK", "0"))))
    except ValueError as exc:
        raise ArgumentError(f"RANK, WORLD_SIZE and LOCAL_RANK must be integers, got "
                            f"{[os.environ.get(n) for n in names]}") from exc
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise ArgumentError(f"RANK={rank}, WORLD_SIZE={world_size}, LOCAL_RANK={local_rank}: "
                            "need WORLD_SIZE >= 1 and 0 <= RANK < WORLD_SIZE (launch with "
                            "torchrun or accelerate launch, which set them)")
    if world_size > 1 and dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise ArgumentError(f"a process group of rank {dist.get_rank()} of "
                                f"{dist.get_world_size()} exists, but the launcher says rank "
                                f"{rank} of {world_size}")
    elif world_size > 1:
        missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if n not in os.environ]
        if missing:
            raise ArgumentError(f"WORLD_SIZE={world_size} but {' and '.join(missing)} not "
                                "set: launch with torchrun or accelerate launch, which set them")
    return rank, world_size, local_rank


def _rank_device(device: str | None, local_rank: int) -> str | None:
    """``device`` for this rank: a CUDA device becomes the rank's own, ``cuda:LOCAL_RANK``."""
    if device is not None and str(device).startswith("cuda"):
        return f"cuda:{local_rank}"
    return device


def _join(rank: int, world_size: int, device: torch.device) -> None:
    """Start this rank's process group (NCCL for CUDA, gloo otherwise) unless one exists."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)


def _load(engine: str, path: str | None, dtype: str, device: str | None,
          options: dict[str, Any]) -> Any:
    """The seqstate model ``--model_args engine=...,path=...`` names, on ``device``."""
    registry.get(engine)                          # ArgumentError naming the engines
    if engine == "vllm":
        return _connect(path, options)
    if "url" in options:
        raise ArgumentError(f"url= names a vLLM server: pass engine=vllm with it (got "
                            f"engine={engine}, which loads the model here)")
    torch_dtype = getattr(torch, str(dtype), None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ArgumentError(f"dtype must name a torch dtype (float32, bfloat16, ...), got {dtype!r}")
    if engine != "hf" and device not in (None, "cpu"):
        raise ArgumentError(f"device={device!r}: the {engine} engine here runs on the CPU "
                            "(only the hf engine takes a device); pass --device cpu, or "
                            "engine=hf to run on that device")
    where = {} if device is None else {"device": device}
    if path is None:
        if engine == "hf":
            return ss.models.default(dtype=torch_dtype, **where, **options)
        return ss.models.default(engine=engine, **options)
    if engine == "llama.cpp":
        return ss.models.llamacpp(path, **options)
    if options:
        raise ArgumentError(f"{sorted(options)} are not options of the hf engine")
    return ss.models.transformers(path, dtype=torch_dtype, **where)


def _connect(path: str | None, options: dict[str, Any]) -> Any:
    """The model on the vLLM server ``url=`` names (``--model_args engine=vllm,url=...``)."""
    url = options.pop("url", None)
    if not url or path is not None:
        raise ArgumentError("engine=vllm scores on a running vLLM server: pass url=... (and "
                            "api_key=... where it needs a key) instead of a path; start one "
                            "with `python -m seqstate.vllm serve [--model PATH]`")
    return ss.models.vllm(str(url), **options)


def _check_device(model: Any, device: str | None) -> None:
    """A model given as ``model=`` runs where it was loaded: ``device`` may only name it."""
    if device is None:
        return
    try:
        asked = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ArgumentError(f"device must name a torch device ('cpu', 'cuda:0', ...), got "
                            f"{device!r}") from exc
    here = model.device
    if asked.type != here.type or asked.index not in (None, here.index):
        raise ArgumentError(f"device={device!r}, but the model given as model= is on {here}; "
                            "load it on that device (ss.models.transformers(path, "
                            "device=...)) or leave device out")
