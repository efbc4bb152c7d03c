"""Deploying the vllm engine: ``python -m seqstate.vllm serve`` with vLLM's flags, an API key
and TLS, and lm-eval scoring on a server.

One second server (module-scoped) is started the way a user starts one, through the command
line: ``--api-key``, ``--dtype``, ``--max-model-len``, and after ``--`` vLLM's own TLS flags
verbatim, with a certificate ``openssl`` makes here for 127.0.0.1.  Every key, TLS and lm-eval
test talks to it; the flags are read back from the server (its model list, its log).  What
``serve`` decides before starting anything (the device's profile, the warning for an exposed
host) is checked without a server.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

import seqstate as ss
from seqstate.backends.vllm.server import (EXACT, FLAGS, PLUGINS, RUNNER_ENV, Server, loopback,
                                           server_python)
from seqstate.backends.vllm.serve import parser
from seqstate.lm_eval import SeqStateLM
from seqstate.vllm import main

from test_lm_eval import arc

KEY = "sk-test-" + secrets.token_hex(12)
ENV = "SEQSTATE_VLLM_API_KEY"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 and its key (PEM files)."""
    folder = tmp_path_factory.mktemp("tls")
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return key, cert


@pytest.fixture(scope="module")
def keyed(certificate, tmp_path_factory):
    """``python -m seqstate.vllm serve`` with a key, flags and TLS: (url, cert, log path)."""
    key, cert = certificate
    log = tmp_path_factory.mktemp("keyed") / "serve.log"
    try:
        server_python()
    except ss.ModelNotAvailable as exc:
        if os.environ.get("SEQSTATE_REQUIRE_VLLM"):
            raise
        pytest.skip(f"no vLLM server environment: {exc}")
    with open(log, "w") as err:
        serve = subprocess.Popen(
            [sys.executable, "-m", "seqstate.vllm", "serve", "--api-key", KEY,
             "--dtype", "float32", "--max-model-len", "3072",
             "--", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert)],
            stdout=subprocess.PIPE, stderr=err, text=True, env=os.environ | {ENV: ""})
    try:
        url = serve.stdout.readline().strip()      # printed once /health answers
        assert url, f"serve exited ({serve.wait()}):\n{log.read_text()[-3000:]}"
        yield url, cert, log
    finally:
        serve.send_signal(signal.SIGTERM)          # serve stops its server, then exits
        assert serve.wait(120) == 0


def _get(url: str, cert, key: str | None = None) -> tuple[int, dict]:
    """A raw GET (no seqstate client): status and JSON body."""
    request = urllib.request.Request(url)
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    context = ssl.create_default_context(cafile=str(cert))
    try:
        with urllib.request.urlopen(request, context=context, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# -- serve: flags through to vLLM ------------------------------------------------------------
@pytest.mark.vllm
def test_serve_passes_its_flags_and_everything_after_the_dashes_to_vllm(keyed):
    url, cert, log = keyed
    assert url.startswith("https://127.0.0.1:")                # --ssl-certfile reached vLLM
    status, models = _get(url + "/v1/models", cert, KEY)
    assert status == 200 and models["data"][0]["max_model_len"] == 3072
    started = log.read_text()
    assert "'dtype': 'float32'" in started and "'ssl_certfile'" in started
    assert KEY not in started                    # handed over in the environment, not logged


@pytest.mark.vllm
def test_vllms_own_check_refuses_requests_without_the_key(keyed):
    url, cert, _ = keyed
    assert _get(url + "/v1/models", cert)[0] == 401
    assert _get(url + "/v1/models", cert, "sk-wrong")[0] == 401


# -- the client: a key, TLS --------------------------------------------------------------------
@pytest.mark.vllm
def test_a_missing_or_wrong_key_is_a_typed_error_at_construction(keyed, monkeypatch):
    url, cert, _ = keyed
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(ss.AuthenticationError, match="needs an API key.*api_key=") as missing:
        ss.models.vllm(url, ca_certs=cert)
    with pytest.raises(ss.AuthenticationError, match="refused the API key.*--api-key") as wrong:
        ss.models.vllm(url, ca_certs=cert, api_key="sk-wrong")
    for err in (missing.value, wrong.value):
        assert isinstance(err, ss.EngineError) and isinstance(err, PermissionError)
        assert KEY not in str(err) and "sk-wrong" not in str(err)


@pytest.mark.vllm
def test_the_key_from_the_environment_generates_as_the_hf_engine(keyed, real, monkeypatch):
    url, cert, _ = keyed
    monkeypatch.setenv(ENV, KEY)
    model = ss.models.vllm(url, ca_certs=cert)
    try:
        prompt = "The three primary colours are"
        got = ss.text(model)(prompt, max_tokens=12)
        assert got.token_ids == ss.text(real)(prompt, max_tokens=12).token_ids
        digits = ss.regex(model, r"[0-9]{3}")("Code: ")
        assert digits.value.isdigit() and len(digits.value) == 3
    finally:
        model.close()


@pytest.mark.vllm
def test_https_checks_the_certificate(keyed, monkeypatch):
    url, cert, _ = keyed
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    with pytest.raises(ss.EngineError, match="TLS handshake.*ca_certs=") as untrusted:
        ss.models.vllm(url, api_key=KEY)               # self-signed: not trusted by default
    assert not isinstance(untrusted.value, ss.AuthenticationError)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))      # the system-wide way to trust it
    model = ss.models.vllm(url, api_key=KEY)
    assert ss.text(model)("Hi", max_tokens=2).shape == (1, 1)
    model.close()
    with pytest.raises(ss.EngineError):                # plain http to a TLS port
        ss.models.vllm(url.replace("https://", "http://"), api_key=KEY, timeout=20)


def test_a_url_without_its_scheme_is_refused_before_any_request():
    with pytest.raises(ss.ArgumentError, match="http:// or https://"):
        ss.models.vllm("127.0.0.1:8000")


# -- lm-eval on the server ---------------------------------------------------------------------
@pytest.mark.vllm
def test_lm_eval_on_the_server_equals_the_hf_engine(keyed, real, record_property):
    """``--model_args engine=vllm,url=...,api_key=...`` (lm-eval's own parsing of the string)
    on the fp32 server: each log-likelihood within 1e-4 of the hf engine's, the same greedy
    flags."""
    url, cert, _ = keyed
    lm = SeqStateLM.create_from_arg_string(f"engine=vllm,url={url},api_key={KEY},"
                                           f"ca_certs={cert}",
                                           {"batch_size": 1, "device": "cpu"})
    assert lm.model.engine == "vllm"
    instances = arc("rc_5shot", 3, unconditional=2) + arc("mc_5shot", 4)
    got = lm.loglikelihood(instances, disable_tqdm=True)
    expected = SeqStateLM(model=real).loglikelihood(instances, disable_tqdm=True)
    worst = max(abs(g - e) for (g, _), (e, _) in zip(got, expected, strict=True))
    record_property("max_abs_loglik_diff", worst)      # in --junitxml reports
    assert worst < 1e-4, f"max |d loglik| {worst:.2e}"
    assert [g for _, g in got] == [g for _, g in expected]
    assert any(g for _, g in got) and not all(g for _, g in got)   # both flags occur here
    lm.model.close()


# -- what serve decides before starting anything -----------------------------------------------
def _server(kind=Server, **options) -> Server:
    """A `Server` that is never started (no server environment needed: any Python file)."""
    return kind(python=sys.executable, **{"runner_v2": False, **options})


STAND_IN = """
import http.server
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", {port}), Health).serve_forever()
"""


class _StandIn(Server):
    """A `Server` whose process is a stand-in that answers ``/health`` (no vLLM needed)."""

    def command(self) -> list[str]:
        return [sys.executable, "-c", STAND_IN.format(port=self.port)]


def test_a_server_started_from_a_thread_outlives_the_thread():
    # Linux ends a child marked "end with parent" when the *thread* that forked it ends
    server = _server(_StandIn)
    starter = threading.Thread(target=server.start)
    starter.start()
    starter.join()
    try:
        deadline = time.monotonic() + 2
        while server.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.process.poll() is None and server.healthy()
    finally:
        server.stop()


def test_a_cpu_gets_the_exact_profile_and_cuda_gets_vllms_defaults():
    cpu = _server(cuda=False).command()
    for flag in (*FLAGS, *EXACT):
        assert flag in cpu
    assert cpu[cpu.index("--kv-cache-memory-bytes") + 1] == str(2**30)
    cuda = _server(cuda=True).command()
    for flag in FLAGS:
        assert flag in cuda                            # what seqstate's requests need
    for flag in ("--dtype", "--enforce-eager", "--block-size", "--max-model-len",
                 "--kv-cache-memory-bytes", "--gpu-memory-utilization"):
        assert flag not in cuda                        # vLLM's own defaults
    tuned = _server(cuda=True, dtype="bfloat16", tensor_parallel_size=2, max_model_len=4096,
                    gpu_memory_utilization=0.8, extra_args=("--block-size", "16")).command()
    assert tuned[-10:] == ["--dtype", "bfloat16", "--tensor-parallel-size", "2",
                           "--max-model-len", "4096", "--gpu-memory-utilization", "0.8",
                           "--block-size", "16"]             # vLLM's flags last: they win
    assert _server(cuda=True, kv_cache_gib=4).command()[-1] == str(4 * 2**30)
    with pytest.raises(ss.ArgumentError, match="once"):
        _server(cuda=True, kv_cache_gib=4, gpu_memory_utilization=0.5)


# vLLM's own answer, in the server environment: the runner its config runs (the defaults:
# nothing that makes it fall back to V1) for each value of the variable, or why it refuses
_VLLMS_CHOICE = f"""import json, os
from vllm.config import VllmConfig
out = {{}}
for value in (None, "1"):
    os.environ.pop("{RUNNER_ENV}", None)
    if value is not None:
        os.environ["{RUNNER_ENV}"] = value
    try:
        out[str(value)] = VllmConfig().use_v2_model_runner
    except Exception as exc:
        out[str(value)] = str(exc)
print(json.dumps(out))
"""


@pytest.mark.vllm
def test_serve_passes_the_processor_of_the_runner_vllm_runs(vllm_python, monkeypatch):
    """The processor passed is the one for the model runner the server environment's vLLM
    runs, and the variable is pinned to match: unset, vLLM's choice (V1 on this CPU build,
    which has no usable Triton); set, the user's (kept, even where vLLM then refuses to
    start, as it does V2 here); a value vLLM cannot read is refused before anything starts."""
    run = subprocess.run([str(vllm_python), "-c", _VLLMS_CHOICE], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    vllms = json.loads(run.stdout.strip().splitlines()[-1])
    assert vllms["None"] is False
    assert "requires Triton" in vllms["1"]                 # no V2 server on this CPU
    for value, v2 in ((None, False), ("1", True)):
        monkeypatch.delenv(RUNNER_ENV, raising=False)
        if value is not None:
            monkeypatch.setenv(RUNNER_ENV, value)
        server = Server(python=vllm_python, cuda=None if value is None else False)
        assert server.runner_v2 is v2 and not server.cuda
        command = server.command()
        assert command[command.index("--logits-processors") + 1] == PLUGINS[v2]
        assert server.environment()[RUNNER_ENV] == str(int(v2))
    monkeypatch.setenv(RUNNER_ENV, "yes")
    with pytest.raises(ss.ArgumentError, match=RUNNER_ENV):
        Server(python=vllm_python)


@pytest.mark.vllm
def test_the_environment_is_probed_once_per_process(vllm_python, monkeypatch):
    """Each `Server` needs to know whether its environment's torch sees CUDA and which model
    runner its vLLM picks (a subprocess that imports vLLM); the second one does not ask again."""
    monkeypatch.delenv(RUNNER_ENV, raising=False)
    first = Server(python=vllm_python)
    asked = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: asked.append(a))
    second = Server(python=vllm_python)
    assert not asked
    assert (second.cuda, second.runner_v2) == (first.cuda, first.runner_v2)


def test_the_key_goes_to_vllm_in_the_environment_not_the_command_line(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    server = _server(cuda=False, api_key=KEY)
    assert KEY not in " ".join(server.command()) and "--api-key" not in server.command()
    assert server.environment()["VLLM_API_KEY"] == KEY and server.keyed
    bare = _server(cuda=False)
    assert "VLLM_API_KEY" not in bare.environment() and not bare.keyed


def test_serves_key_defaults_to_the_clients_variable(monkeypatch):
    monkeypatch.setenv(ENV, KEY)
    assert parser().parse_args(["serve"]).api_key == KEY
    assert parser().parse_args(["serve", "--api-key", "other"]).api_key == "other"
    monkeypatch.setenv(ENV, "")
    assert parser().parse_args(["serve"]).api_key is None


def test_loopback_hosts():
    assert all(map(loopback, ["127.0.0.1", "127.0.0.2", "::1", "localhost"]))
    assert not any(map(loopback, ["0.0.0.0", "::", "10.1.2.3", "example.org"]))


@pytest.mark.parametrize("argv, warned", [
    (["--host", "0.0.0.0"], True),
    (["--host", "192.168.1.7", "--", "--ssl-certfile", "c.pem"], True),
    (["--host", "0.0.0.0", "--api-key", "k"], False),
    (["--host", "0.0.0.0", "--", "--api-key", "k"], False),
    (["--host", "127.0.0.1"], False)])
def test_an_exposed_host_without_a_key_is_warned_about(argv, warned, tmp_path, capsys,
                                                       monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    # a Python that is not there: serve stops with an error before anything starts
    assert main(["serve", "--python", str(tmp_path / "none"), *argv]) == 2
    err = capsys.readouterr().err
    assert ("without an API key" in err) == warned
    assert "error: no Python at" in err
