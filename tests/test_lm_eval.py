"""`seqstate.lm_eval`: the lm-evaluation-harness model against lm-eval's own HF backend.

The same `Instance`s go through ``lm_eval.models.huggingface.HFLM`` and `SeqStateLM` on the
same weights: identical greedy flags, identical accuracy, and log-likelihoods equal to fp32
noise (`assert_close`: per answer token, a multiple of the noise floor measured on this CPU).
The performance target's "within 1e-4" is not a bound these checks can keep on every CPU: one token's
log-prob alone moves by ~1e-4 between batch shapes on the tiny model.

lm-eval is installed by ``make install`` with the rest of the suite's tools, so a missing or
broken lm-eval fails here loudly rather than skipping.
"""

import gzip
import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM

import seqstate as ss
from seqstate.lm_eval import SeqStateLM
from conftest import assert_close

ARC = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "arc_easy"
if not ARC.is_dir():                                    # a checkout beside shared/ or inside it
    ARC = pathlib.Path(__file__).resolve().parents[1] / "shared" / "data" / "arc_easy"


def arc(name: str, questions: int, unconditional: int = 0) -> list[Instance]:
    """The ARC-Easy requests of the first ``questions`` questions (and the bare-"Answer:"
    requests of the first ``unconditional``) as lm-eval `Instance`s."""
    path = ARC / f"{name}.requests.jsonl.gz"
    if not path.is_file():
        pytest.skip(f"{path} is not there (shared/ data)")
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    keep = [r for r in rows if r["doc_id"] < questions
            or 1_000_000 <= r["doc_id"] < 1_000_000 + unconditional]
    return [Instance("loglikelihood", r["doc"] | {"doc_id": r["doc_id"]},
                     (r["request"]["context"], r["request"]["continuation"]), r["idx"])
            for r in keep]


def accuracy(instances: list[Instance], results: list[tuple[float, bool]]) -> float:
    """Share of questions whose gold answer has the highest summed log-prob."""
    best: dict[int, tuple[float, int, int]] = {}
    for inst, (logprob, _) in zip(instances, results):
        doc = inst.doc
        if doc["doc_id"] < 1_000_000 and logprob > best.get(doc["doc_id"], (-math.inf,))[0]:
            best[doc["doc_id"]] = (logprob, inst.idx, doc["gold"])
    return sum(idx == gold for _, idx, gold in best.values()) / len(best)


def hf_backend(model, **options) -> HFLM:
    """lm-eval's own HF backend on the same weights and tokenizer (batched, logits cache on)."""
    return HFLM(pretrained=model.hf_model, tokenizer=model.hf_tokenizer,
                batch_size=options.pop("batch_size", 8), **options)


def assert_loglikelihoods(lm, instances, expected, got):
    """Each log-likelihood within fp32 noise of lm-eval's: one term per answer token."""
    for inst, want, have in zip(instances, expected, got, strict=True):
        context, continuation = inst.args
        answer = lm._encode_pair(context, continuation)[1] if context else \
            lm.tok_encode(continuation)              # lm-eval refuses an empty context here
        terms = max(1, len(answer))
        assert_close(have, want, lm.model, "a log-likelihood vs lm-eval's", terms=terms)


def assert_parity(lm, instances, expected, got):
    assert len(got) == len(expected) == len(instances)
    assert_loglikelihoods(lm, instances, [e for e, _ in expected], [g for g, _ in got])
    assert [g for _, g in got] == [g for _, g in expected]
    assert accuracy(instances, got) == accuracy(instances, expected)


def test_tokenisation_is_lm_evals(tiny):
    lm, hf = SeqStateLM(model=tiny), hf_backend(tiny)
    for context, continuation in [("Question: why?\nAnswer:", " because"),
                                  ("Trailing space ", "moves"), ("a", "b c d")]:
        assert lm._encode_pair(context, continuation) == hf._encode_pair(context, continuation)
    assert (lm.prefix_token_id, lm.eot_token_id) == (hf.prefix_token_id, hf.eot_token_id)
    assert lm.max_length == hf.max_length == tiny.context_length


def test_arc_parity_on_the_tiny_model(tiny):
    """80 rc pairs (20 questions) with their unconditional twins and 40 mc pairs, shuffled
    together: every pair as lm-eval's HF backend scores it."""
    instances = arc("rc_5shot", 20, unconditional=5) + arc("mc_5shot", 10)
    instances = instances[::2] + instances[1::2]           # request order is not context order
    expected = hf_backend(tiny).loglikelihood(instances, disable_tqdm=True)
    lm = SeqStateLM(model=tiny)
    assert_parity(lm, instances, expected, lm.loglikelihood(instances, disable_tqdm=True))


@pytest.mark.real
def test_arc_parity_on_the_default_model(real):
    instances = arc("rc_5shot", 3, unconditional=2) + arc("mc_5shot", 6)
    expected = hf_backend(real).loglikelihood(instances, disable_tqdm=True)
    lm = SeqStateLM(model=real)
    got = lm.loglikelihood(instances, disable_tqdm=True)
    assert_parity(lm, instances, expected, got)
    assert any(g for _, g in got) and not all(g for _, g in got)   # both flags occur here


def test_empty_context_and_empty_answer(tiny):
    """An empty context stands for the prefix token (BOS) as in lm-eval; an empty answer
    scores 0 without a model call."""
    instances = [Instance("loglikelihood", {}, ("", "Hello world"), 0),
                 Instance("loglikelihood", {}, ("", " spaced"), 0)]
    expected = hf_backend(tiny).loglikelihood(instances, disable_tqdm=True)
    lm = SeqStateLM(model=tiny)
    got = lm.loglikelihood(instances, disable_tqdm=True)
    assert_loglikelihoods(lm, instances, [e for e, _ in expected], [g for g, _ in got])
    assert lm._loglikelihood_tokens([(None, [1, 2], [])], disable_tqdm=True) == [(0.0, True)]


TEXTS = ["The quick brown fox jumps over the lazy dog. " * 6,
         "Lorem ipsum dolor sit amet, consectetur adipiscing elit.",
         "One"]


@pytest.mark.parametrize("max_length", [32, None])
def test_rolling_matches_lm_eval(tiny, max_length):
    """Disjoint rolling windows (several per text at max_length 32) summed per text."""
    instances = [Instance("loglikelihood_rolling", {}, (t,), 0) for t in TEXTS]
    expected = hf_backend(tiny, max_length=max_length).loglikelihood_rolling(
        instances, disable_tqdm=True)
    lm = SeqStateLM(model=tiny, max_length=max_length)
    got = lm.loglikelihood_rolling(instances, disable_tqdm=True)
    for text, want, have in zip(TEXTS, expected, got, strict=True):
        assert_close(have, want, tiny, "a rolling log-likelihood vs lm-eval's",
                     terms=len(lm.tok_encode(text)))


def test_rolling_over_the_whole_context_window(tiny):
    """A text longer than the model's context: the first window feeds exactly max_length
    tokens and scores max_length."""
    text = " ".join(f"w{i}" for i in range(700))              # ~2,900 tokens, 2 windows
    instances = [Instance("loglikelihood_rolling", {}, (text,), 0)]
    lm = SeqStateLM(model=tiny)
    assert len(lm.tok_encode(text)) > lm.max_length == tiny.context_length
    got = lm.loglikelihood_rolling(instances, disable_tqdm=True)
    expected = hf_backend(tiny).loglikelihood_rolling(instances, disable_tqdm=True)
    assert_close(got[0], expected[0], tiny, "a rolling log-likelihood vs lm-eval's",
                 terms=len(lm.tok_encode(text)))


def test_left_truncation_matches_lm_eval(tiny):
    """A context longer than max_length loses its left end, as in lm-eval."""
    instances = [Instance("loglikelihood", {}, ("word " * 40 + "end", " of it"), 0)]
    expected = hf_backend(tiny, max_length=16).loglikelihood(instances, disable_tqdm=True)
    lm = SeqStateLM(model=tiny, max_length=16)
    got = lm.loglikelihood(instances, disable_tqdm=True)
    assert_loglikelihoods(lm, instances, [expected[0][0]], [got[0][0]])


def generation_requests(stops):
    return [Instance("generate_until", {}, (prompt, {"until": until, "max_gen_toks": n,
                                                     "do_sample": False}), 0)
            for prompt, until, n in stops]


def test_generate_until_matches_lm_eval(tiny):
    """Greedy continuations equal lm-eval's HF backend's (batch 1: no padding), stop strings
    cut as it cuts them."""
    requests = generation_requests([("Once upon a time", ["paint"], 12),    # inside a token
                                    ("The capital of France is", ["Legend", "zz"], 20),
                                    ("1, 2, 3,", ["\n"], 16),
                                    ("Hello", [], 5)])
    expected = hf_backend(tiny, batch_size=1).generate_until(requests, disable_tqdm=True)
    got = SeqStateLM(model=tiny).generate_until(requests, disable_tqdm=True)
    assert got == expected
    assert any(len(g) < len(ss.text(tiny)(r.args[0], max_tokens=r.args[1]["max_gen_toks"]).value)
               for g, r in zip(got, requests))                 # a stop string did cut one


@pytest.mark.real
def test_generate_until_on_the_default_model(real):
    requests = generation_requests([("Question: What is the capital of France?\nAnswer:",
                                     ["\n"], 24),
                                    ("List three colours: red,", ["."], 16)])
    expected = hf_backend(real, batch_size=1).generate_until(requests, disable_tqdm=True)
    assert SeqStateLM(model=real).generate_until(requests, disable_tqdm=True) == expected


@pytest.mark.llamacpp
def test_llamacpp_within_its_noise(llama):
    """On llama.cpp: each pair within the engine's noise of its own fresh evaluation
    (``full_logits``), greedy flags and accuracy equal.  mc answers are one token, so one
    fresh evaluation of the context serves its four options."""
    instances = arc("rc_5shot", 1) + arc("mc_5shot", 4)
    lm = SeqStateLM(model=llama)
    got = lm.loglikelihood(instances, disable_tqdm=True)
    fresh = {}
    expected = []
    for inst in instances:
        context, continuation = lm._encode_pair(*inst.args)
        key = tuple(context + continuation[:-1])
        if key not in fresh:
            fresh[key] = llama.full_logits(list(key)).float().log_softmax(-1)[len(context) - 1:]
        logprobs = fresh[key][-len(continuation):]
        target = torch.tensor(continuation)
        expected.append((float(logprobs.gather(1, target[:, None]).sum()),
                         bool((logprobs.argmax(-1) == target).all())))
        assert_close(got[len(expected) - 1][0], expected[-1][0], llama,
                     "a log-likelihood vs a fresh llama.cpp evaluation", terms=len(continuation))
    assert [g for _, g in got] == [g for _, g in expected]
    assert accuracy(instances, got) == accuracy(instances, expected)


def test_arguments_are_checked():
    with pytest.raises(ss.ArgumentError, match="engine=vllm.*url="):
        SeqStateLM(engine="vllm")
    with pytest.raises(ss.ArgumentError, match="engine=vllm.*url="):
        SeqStateLM(engine="vllm", path="model-folder", url="http://127.0.0.1:1")
    with pytest.raises(ss.ArgumentError, match="url=.*engine=vllm"):
        SeqStateLM(engine="hf", url="http://127.0.0.1:1")
    with pytest.raises(ss.ArgumentError, match="dtype"):
        SeqStateLM(dtype="float33")
    with pytest.raises(ss.ArgumentError, match="path"):
        SeqStateLM(model=object(), path="x")


ROOT = pathlib.Path(__file__).resolve().parents[1]
LOCAL_TASK = ROOT / "docs" / "tutorials" / "lm-eval-task"


def offline_env(tmp_path) -> dict[str, str]:
    return os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                         "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "ds"),
                         "TOKENIZERS_PARALLELISM": "false"}


def logged(folder: pathlib.Path, name: str) -> list[pathlib.Path]:
    return sorted(folder.rglob(f"{name}_*.json*"))


TASK = """task: tiny_arc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {docs}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""


def test_command_line_end_to_end(tiny, tmp_path):
    """``seqstate-lm-eval --model seqstate --model_args path=...`` on a local task (offline):
    each logged log-likelihood equals lm-eval's HF backend on the same requests."""
    docs = {}
    for inst in arc("rc_5shot", 4):
        docs[inst.doc["doc_id"]] = {"question": inst.doc["query"], "choices": inst.doc["choices"],
                                    "gold": inst.doc["gold"]}
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs.values()))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_arc.yaml").write_text(TASK.format(docs=tmp_path / "docs.jsonl"))
    tiny.hf_model.save_pretrained(tmp_path / "model")
    tiny.hf_tokenizer.save_pretrained(tmp_path / "model")
    env = offline_env(tmp_path)
    script = pathlib.Path(sys.executable).parent / "seqstate-lm-eval"
    run = subprocess.run(
        [str(script), "--model", "seqstate", "--model_args", f"path={tmp_path / 'model'}",
         "--tasks", "tiny_arc", "--include_path", str(tmp_path / "tasks"),
         "--output_path", str(tmp_path / "out"), "--log_samples"],
        env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "tiny_arc" in run.stdout and "acc" in run.stdout
    samples = [json.loads(line) for path in (tmp_path / "out").rglob("samples_tiny_arc_*.jsonl")
               for line in path.read_text().splitlines()]
    assert len(samples) == len(docs)
    instances = [Instance("loglikelihood", {}, tuple(arg.values()) if isinstance(arg, dict)
                          else tuple(arg), 0)
                 for s in samples for arg in s["arguments"].values()]
    logged = [float(r[0][0]) for s in samples for r in s["resps"]]
    expected = hf_backend(tiny).loglikelihood(instances, disable_tqdm=True)
    assert_loglikelihoods(SeqStateLM(model=tiny), instances, [e for e, _ in expected], logged)


def test_python_dash_m_registers_the_model(tmp_path):
    """``python -m seqstate.lm_eval`` is the same command line, with ``seqstate`` known."""
    code = ("import runpy, sys; sys.argv = ['x', 'run', '--help']; "
            "runpy.run_module('seqstate.lm_eval', run_name='__main__')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "--model" in run.stdout
    check = ("import seqstate.lm_eval, lm_eval.api.registry as r; "
             "print(r.get_model('seqstate').__name__, r.get_model('hf').__name__)")
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                         timeout=120, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    assert out.stdout.split() == ["SeqStateLM", "HFLM"], out.stderr[-2000:]


@pytest.mark.real
def test_two_processes_under_torchrun_split_the_task(real, tmp_path, monkeypatch):
    """The docs' CPU command, ``torchrun --nproc_per_node 2 -m seqstate.lm_eval``, on the
    shipped offline task: each rank scores its own half of the requests, rank 0 writes the one
    results file, and the metrics and log-likelihoods are one process's (``simple_evaluate``
    here on the same model)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out, logs = tmp_path / "out", tmp_path / "logs"
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "--log-dir", str(logs), "--redirects", "3",
         "-m", "seqstate.lm_eval", "--model", "seqstate", "--tasks", "offline_qa",
         "--include_path", str(LOCAL_TASK), "--output_path", str(out), "--log_samples"],
        cwd=ROOT, env=offline_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    questions = len((LOCAL_TASK / "questions.jsonl").read_text().splitlines())
    for rank in (0, 1):                                  # each rank's own stderr
        (err,) = logs.rglob(f"attempt_0/{rank}/stderr.log")
        text = err.read_text()
        assert f"Building contexts for offline_qa on rank {rank}" in text
        scored = re.findall(r"Running loglikelihood requests: 100%\S* *\| *(\d+)/\d+", text)
        assert scored == [str(questions * 4 // 2)]        # four answers a question, half each

    assert len(logged(out, "results")) == 1 and len(logged(out, "samples_offline_qa")) == 1
    results = json.loads(logged(out, "results")[0].read_text())["results"]["offline_qa"]
    samples = [json.loads(line) for line in
               logged(out, "samples_offline_qa")[0].read_text().splitlines()]
    # gathered in rank order: rank 0 answered the even questions, rank 1 the odd ones
    assert [s["doc_id"] for s in samples] == [*range(0, questions, 2), *range(1, questions, 2)]

    monkeypatch.chdir(ROOT)                              # the task's data_files is relative
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "ds"))
    lm = SeqStateLM(model=real)
    one = lm_eval.simple_evaluate(
        model=lm, tasks=["offline_qa"], log_samples=True,
        task_manager=TaskManager(include_path=str(LOCAL_TASK), include_defaults=False))
    expected = one["results"]["offline_qa"]
    for metric in ("acc,none", "acc_norm,none"):
        assert results[metric] == expected[metric]
    reference = {s["doc_id"]: s for s in one["samples"]["offline_qa"]}
    for sample in samples:
        want = reference[sample["doc_id"]]
        instances = [Instance("loglikelihood", {}, tuple(a), 0) for a in want["arguments"]]
        assert_loglikelihoods(lm, instances, [float(r[0][0]) for r in want["resps"]],
                              [float(r[0][0]) for r in sample["resps"]])


def test_launcher_environment_is_checked(monkeypatch):
    """A data-parallel launch of engine=vllm is refused before any connection (one server
    batches every client); a broken launcher environment is refused too."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(ss.ArgumentError, match="engine=vllm.*already batches"):
        SeqStateLM(engine="vllm", url="http://127.0.0.1:1")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ss.ArgumentError, match="RANK=2, WORLD_SIZE=2"):
        SeqStateLM(engine="vllm", url="http://127.0.0.1:1")
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ss.ArgumentError, match="integers"):
        SeqStateLM(engine="vllm", url="http://127.0.0.1:1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ss.ArgumentError, match="MASTER_ADDR.*torchrun"):
        SeqStateLM(path="no-such-model-folder")           # refused before any loading


def test_a_single_process_is_rank_0_of_1(tiny, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    lm = SeqStateLM(model=tiny)
    assert (lm.rank, lm.world_size, lm.device) == (0, 1, tiny.device)
    count = torch.tensor(3)
    assert lm.all_gather(count) is count and lm.gather_object("x") == ["x"]


def test_the_page_shows_the_shipped_task():
    """lm-eval.md's YAML block is the shipped task file (less its comments), and its JSON
    example is one of the shipped questions."""
    page = (ROOT / "docs" / "tutorials" / "lm-eval.md").read_text()
    blocks = re.findall(r"```(yaml|json)\n(.*?)```", page, re.S)
    shipped = (LOCAL_TASK / "offline_qa.yaml").read_text()
    assert blocks[0][1] == "".join(line for line in shipped.splitlines(keepends=True)
                                   if not line.startswith("#"))
    questions = [json.loads(line) for line in
                 (LOCAL_TASK / "questions.jsonl").read_text().splitlines()]
    assert json.loads(blocks[1][1]) in questions
