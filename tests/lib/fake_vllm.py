"""A fake vLLM OpenAI-compatible API server, run as a real process by the system tests.

Standard library only: it must run under any python3, including interpreters without the daemon's packages.

It accepts the command line the supervisor renders for real vLLM (``--model M --host H --port P
[--served-model-name N ...]`` plus arbitrary other flags, which it ignores) and a few ``--fake-*``
options that reproduce behaviours documented in docs/vllm-notes.md:

``--fake-startup-delay-s F``    listen only after F seconds (real vLLM refuses connections while loading)
``--fake-refuse-canary``        ready, but the first POST /v1/completions is HTTP 500 and the process exits 0
``--fake-crash-after-s F``      exit with ``--fake-exit-code`` (default 0) F seconds after becoming ready
``--fake-ignore-sigterm``       ignore SIGTERM, so only SIGKILL stops it
``--fake-child``                spawn a ``fake-enginecore`` child in the same process group that
                                survives a SIGKILL of this process (the EngineCore orphan problem);
                                SIGTERM kills it
``--fake-completion-delay-s F`` each completion takes F seconds
``--fake-oom-above-max-num-seqs N``  with ``--max-num-seqs`` above N, fail at start like a CUDA OOM
                                (print torch's OutOfMemoryError, exit 1)
``--fake-dev-mode``             serve ``POST /reset_prefix_cache`` (vLLM's dev-mode route; 404 otherwise)
``--fake-metrics-file PATH``    serve this ``/metrics`` body (a capture in tests/fixtures/metrics) instead of
                                the built-in one, which lacks most of real vLLM's families and is far smaller
``--fake-metrics-scale K``      in that body, repeat every series labelled ``engine="0"`` K times as
                                ``engine="0"``..``"K-1"`` (a data-parallel server of K engine cores): a bigger
                                body with the same families, for the benchmark's body-size sweep
``--fake-metrics-advance``      the step and token counters of that body move on every scrape, as on a busy
                                engine (the supervisor then sends no canaries); without it they stay frozen
``--api-key KEY``               as vLLM: every /v1/* request needs ``Authorization: Bearer KEY`` (HTTP 401
                                otherwise); without the flag, the ``VLLM_API_KEY`` environment variable
``--task embed``, ``--runner pooling``, ``--convert embed``  an embedding model, as vLLM: /v1/embeddings
                                answers, /v1/completions is HTTP 400
``--disable-access-log-for-endpoints P1,P2``  no access lines for these paths (vLLM 0.32's flag)
``--fake-cuda-gib F``           at start, before listening, hold F GiB on CUDA device 0 through torch (the one
                                import outside the standard library, made only with this flag; a failure is
                                printed and the process exits 1), as vLLM's weights and KV cache would;
                                the GPU proof (bench/gpu_proof.py, check 7) reads ``GET /fake/cuda``
``--fake-scrape-log PATH``      append ``time.monotonic()`` of every ``GET /metrics`` to PATH, one per line:
                                the benchmark reads the daemon's observation rounds from it
``--fake-step-heartbeat PATH``  write the step heartbeat that real vLLM writes under the daemon's
                                ``--scheduler-cls``, with the plugin's own writer (``Heartbeat``,
                                llmsupervisor/probes/vllm_plugin/llmsupervisor_step_heartbeat.py): a step
                                every ``--fake-step-s`` (0.02) while it holds work (a completion being served,
                                or always with ``--fake-metrics-advance``: the body's requests running), none
                                while idle or hung, as vLLM's scheduler; the daemon reads
                                ``STATE_DIR/engines/NAME/step-heartbeat``, so that is the PATH to give

Control endpoints: ``POST /fake/crash?code=N`` (exit N at once, child left behind), ``POST /fake/hang``
(completions never answer from now on, /health stays 200), ``POST /fake/die-engine`` (/health 503 from now on,
exit 0 four seconds later, like vLLM's launcher watchdog), ``POST /fake/kv?usage=F`` (report KV-cache
usage F), ``POST /fake/leak?mib_per_s=F`` (grow the RSS by F MiB a second, up to
LEAK_LIMIT_MIB: a slow leak), ``GET /fake/args`` (the command line it was started with), ``GET /fake/cuda``
(the CUDA environment it was given, and with ``--fake-cuda-gib`` what CUDA shows it: device count, device 0's
UUID, bytes held).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NoReturn, TextIO
from urllib.parse import parse_qs, urlsplit

VERSION = "0.32.0"
CHILD_MARKER = "fake-enginecore"
# The child resets SIGTERM (SIG_IGN would be inherited from --fake-ignore-sigterm) and has no parent-death
# detection, like vLLM's EngineCore.
CHILD_CODE = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_DFL); "
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: time.sleep(3600)"
)


def log(level: str, msg: str) -> None:
    """Print one line in vLLM's log format, e.g. ``INFO 11-22 12:00:00 [fake_vllm.py:42] msg``.

    Real vLLM 0.32.0 prefixes each line with ``(APIServer pid=N) `` (``(EngineCore pid=N)``,
    ``(Worker pid=N)`` in the children); the fake leaves the prefix out.
    """
    line = sys._getframe(1).f_lineno
    stamp = time.strftime("%m-%d %H:%M:%S")
    stream = sys.stdout if level == "INFO" else sys.stderr
    print(f"{level} {stamp} [fake_vllm.py:{line}] {msg}", file=stream, flush=True)


# Counters of a captured body that advance per scrape with --fake-metrics-advance, and by how much:
# enough that the supervisor sees steps and tokens move, as on an engine generating.
ADVANCING = {
    "vllm:iteration_tokens_total_count": 40,
    "vllm:iteration_tokens_total_sum": 360,
    "vllm:generation_tokens_total": 320,
    "vllm:prompt_tokens_total": 40,
    "vllm:request_success_total": 1,  # per finished_reason: requests finish, as under real traffic
}


class FileMetrics:
    """A captured ``/metrics`` body, optionally grown (``scale``) and with moving counters (``advance``)."""

    def __init__(self, text: str, *, scale: int, advance: bool) -> None:
        self.lines: list[str] = []
        self.moving: list[tuple[int, str, float, int]] = []  # (line index, "name{labels}", base, step)
        for line in text.splitlines():
            copies = [line]
            if scale > 1 and not line.startswith("#") and 'engine="0"' in line:
                copies = [line.replace('engine="0"', f'engine="{i}"') for i in range(scale)]
            for copy in copies:
                series, _, value = copy.rpartition(" ")
                name = series.partition("{")[0]
                if advance and name in ADVANCING:
                    self.moving.append((len(self.lines), series, float(value), ADVANCING[name]))
                self.lines.append(copy)
        self.scrapes = 0
        self.lock = threading.Lock()

    def render(self) -> bytes:
        with self.lock:
            self.scrapes += 1
            n = self.scrapes
        lines = self.lines
        if self.moving:
            lines = list(lines)
            for index, series, base, step in self.moving:
                lines[index] = f"{series} {base + n * step}"
        return ("\n".join(lines) + "\n").encode()


# The step heartbeat's writer, loaded from its file: the plugin is standard library only, and
# the fake must not import the daemon's package (it runs under any python3).
PLUGIN = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "llmsupervisor",
    "probes",
    "vllm_plugin",
    "llmsupervisor_step_heartbeat.py",
)


def running_in_body(text: str) -> int:
    """The requests a captured body shows running (engine 0's ``vllm:num_requests_running``)."""
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running{"):
            return int(float(line.rpartition(" ")[2]))
    return 0


class FakeSteps:
    """The step heartbeat of real vLLM's scheduler, written by the plugin's own ``Heartbeat``: a
    step every ``step_s`` while the engine holds work, none while it is idle or hung (a hung
    engine takes no step), so the daemon reads the file as it would read vLLM's."""

    def __init__(self, engine: FakeEngine, path: str, step_s: float) -> None:
        spec = importlib.util.spec_from_file_location("llmsupervisor_step_heartbeat", PLUGIN)
        assert spec is not None and spec.loader is not None
        plugin = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(plugin)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.beat = plugin.Heartbeat(path)
        self.engine, self.step_s = engine, step_s
        threading.Thread(target=self._run, name="fake-steps", daemon=True).start()

    def _held(self) -> int:
        engine = self.engine
        with engine.lock:
            return engine.busy_requests + engine.running

    def _run(self) -> None:
        while True:
            held = 0 if self.engine.hung.is_set() else self._held()
            if not held:
                time.sleep(self.step_s)  # idle: vLLM's scheduler takes no step
                continue
            self.beat.on_schedule(held)
            time.sleep(self.step_s)
            self.beat.on_done(self._held())


MIB = 1024 * 1024
LEAK_LIMIT_MIB = 1536  # the host has 24 GiB; a leak that stops here is still a leak to the detector


class FakeEngine:
    """Shared state of the fake server: flags, counters and the fake EngineCore child."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model_name: str = args.served_model_name[0] if args.served_model_name else args.model
        self.served_names: list[str] = args.served_model_name or [args.model]
        keys = args.api_key or [os.environ.get("VLLM_API_KEY", "")]
        self.api_keys = [k for k in keys if k]
        self.embedding = "embed" in (args.task, args.convert, args.runner) or args.task == "embedding"
        self.quiet_paths = {
            p.strip() for p in (args.disable_access_log_for_endpoints or "").split(",") if p.strip()
        }
        self.lock = threading.Lock()
        self.running = 0
        self.cuda: dict[str, Any] = {
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER"),
        }
        self.cuda_memory: object = None  # the tensor --fake-cuda-gib holds
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.iterations = 0
        self.successes = 0
        self.dead = False  # EngineCore died: /health 503, completions 500
        self.kv_usage: float | None = None  # set by POST /fake/kv
        self.hung = threading.Event()  # completions never answer
        self.child: subprocess.Popen[bytes] | None = None
        self.file_metrics: FileMetrics | None = None
        # Requests a busy body shows running for ever (--fake-metrics-advance): the step heartbeat
        # holds them too.
        self.busy_requests = 0
        if args.fake_metrics_file:
            with open(args.fake_metrics_file, encoding="utf-8") as f:
                text = f.read()
            self.file_metrics = FileMetrics(
                text, scale=args.fake_metrics_scale, advance=args.fake_metrics_advance
            )
            if args.fake_metrics_advance:
                self.busy_requests = max(1, running_in_body(text))
        self.scrape_log: TextIO | None = None
        if args.fake_scrape_log:
            # Line-buffered: one short write per scrape, readable while the fake runs.
            self.scrape_log = open(args.fake_scrape_log, "a", buffering=1)  # noqa: SIM115

    def spawn_child(self) -> None:
        self.child = subprocess.Popen(
            [sys.executable, "-c", CHILD_CODE, CHILD_MARKER], stdin=subprocess.DEVNULL
        )
        log("INFO", f"Started fake EngineCore pid={self.child.pid}")

    def stop_child(self, sig: int = signal.SIGTERM) -> None:
        if self.child is None or self.child.poll() is not None:
            return
        self.child.send_signal(sig)
        try:
            self.child.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.child.kill()

    def exit(self, code: int, *, clean_child: bool = True) -> NoReturn:
        """Leave at once from any thread; server threads are daemons and need no join."""
        if clean_child:
            self.stop_child()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def exit_later(self, delay_s: float, code: int, why: str) -> None:
        def fire() -> None:
            log("ERROR" if code else "INFO", f"{why}; exiting with code {code}")
            self.exit(code)

        timer = threading.Timer(delay_s, fire)
        timer.daemon = True
        timer.start()

    def start_leak(self, rate_mib_per_s: float) -> None:
        """Grow the RSS steadily, as a slow leak does: touched pages, kept forever."""
        held: list[bytearray] = []

        def leak() -> None:
            while len(held) < LEAK_LIMIT_MIB:
                held.append(bytearray(b"x" * MIB))  # written, so resident
                time.sleep(1.0 / rate_mib_per_s)

        threading.Thread(target=leak, daemon=True).start()
        log("WARNING", f"fake leak: {rate_mib_per_s} MiB/s")

    def kill_engine(self, reason: str) -> None:
        with self.lock:
            self.dead = True
        self.stop_child(signal.SIGKILL)
        log("ERROR", f"AsyncLLM output_handler failed. EngineDeadError: {reason}")

    def metrics(self) -> str:
        labels = f'engine="0",model_name="{self.model_name}"'
        with self.lock:
            running, prompt, gen, its, ok = (
                self.running,
                self.prompt_tokens,
                self.generation_tokens,
                self.iterations,
                self.successes,
            )
        kv = min(1.0, running * 0.01) if self.kv_usage is None else self.kv_usage
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {float(running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} 0.0",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {kv}",
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{labels}}} {float(prompt)}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{labels}}} {float(gen)}",
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
            f'vllm:request_success_total{{{labels},finished_reason="length"}} {float(ok)}',
            "# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.",
            "# TYPE vllm:iteration_tokens_total histogram",
            f'vllm:iteration_tokens_total_bucket{{{labels},le="1.0"}} {float(its)}',
            f'vllm:iteration_tokens_total_bucket{{{labels},le="+Inf"}} {float(its)}',
            f"vllm:iteration_tokens_total_count{{{labels}}} {float(its)}",
            f"vllm:iteration_tokens_total_sum{{{labels}}} {float(prompt + gen)}",
        ]
        return "\n".join(lines) + "\n"


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that left before its answer (a probe abandoned at its deadline) is what uvicorn
        # logs without a traceback too; anything else is still printed.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


def make_handler(engine: FakeEngine) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "uvicorn"
        sys_version = ""

        def log_message(self, format: str, *args: Any) -> None:
            pass  # access lines are printed by send_body, in uvicorn's format

        def send_body(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()
            host, port = self.client_address[:2]
            phrase = HTTPStatus(status).phrase
            if urlsplit(self.path).path in engine.quiet_paths:
                return
            print(
                f'INFO:     {host}:{port} - "{self.command} {self.path} HTTP/1.1" {status} {phrase}',
                flush=True,
            )

        def send_json(self, status: int, obj: Any) -> None:
            self.send_body(status, json.dumps(obj).encode())

        def send_error_json(self, status: int, message: str, kind: str) -> None:
            self.send_json(
                status, {"error": {"message": message, "type": kind, "param": None, "code": status}}
            )

        def read_json(self) -> Any:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                return json.loads(raw or b"{}")
            except ValueError:
                return None

        def authorized(self) -> bool:
            """vLLM's AuthenticationMiddleware: /v1/* needs one of the keys as a Bearer token."""
            if not engine.api_keys or not urlsplit(self.path).path.startswith("/v1"):
                return True
            scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
            if scheme.lower() == "bearer" and token in engine.api_keys:
                return True
            self.send_json(401, {"error": "Unauthorized"})
            return False

        def do_GET(self) -> None:
            path = urlsplit(self.path).path
            if not self.authorized():
                return
            if path in ("/health", "/ping"):
                self.send_body(503 if engine.dead else 200, b"")
            elif path == "/v1/models":
                created = int(time.time())
                data = [
                    {
                        "id": name,
                        "object": "model",
                        "created": created,
                        "owned_by": "vllm",
                        "root": engine.args.model,
                    }
                    for name in engine.served_names
                ]
                self.send_json(200, {"object": "list", "data": data})
            elif path == "/metrics":
                if engine.scrape_log is not None:
                    with engine.lock:
                        engine.scrape_log.write(f"{time.monotonic():.6f}\n")
                body = engine.file_metrics.render() if engine.file_metrics else engine.metrics().encode()
                self.send_body(200, body, "text/plain; version=0.0.4; charset=utf-8")
            elif path == "/fake/args":
                self.send_json(200, {"argv": sys.argv[1:]})
            elif path == "/fake/cuda":
                self.send_json(200, engine.cuda)
            elif path == "/version":
                self.send_json(200, {"version": VERSION})
            else:
                self.send_json(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            url = urlsplit(self.path)
            if not self.authorized():
                return
            if url.path == "/v1/completions":
                if engine.embedding:
                    self.send_error_json(400, "The model does not support Completions API", "BadRequestError")
                else:
                    self.completion()
            elif url.path == "/v1/embeddings" and engine.embedding:
                self.embeddings()
            elif url.path == "/fake/crash":
                code = int(parse_qs(url.query).get("code", ["1"])[0])
                log("ERROR", f"fake crash requested, exit code {code}")
                engine.exit(code, clean_child=False)
            elif url.path == "/fake/kv":
                engine.kv_usage = float(parse_qs(url.query)["usage"][0])
                self.send_json(200, {"kv_cache_usage_perc": engine.kv_usage})
            elif url.path == "/reset_prefix_cache" and engine.args.fake_dev_mode:
                log("INFO", "Resetting prefix cache")
                self.send_json(200, {"success": True})
            elif url.path == "/fake/leak":
                rate_mib_per_s = float(parse_qs(url.query).get("mib_per_s", ["8"])[0])
                engine.start_leak(rate_mib_per_s)
                self.send_json(200, {"leaking_mib_per_s": rate_mib_per_s})
            elif url.path == "/fake/hang":
                engine.hung.set()
                log("WARNING", "fake hang: completions will never answer")
                self.send_json(200, {"status": "hung"})
            elif url.path == "/fake/die-engine":
                engine.kill_engine("EngineCore died unexpectedly (fake).")
                self.send_json(200, {"status": "engine dead"})
                engine.exit_later(4.0, 0, "Engine core died; shutting down the API server")
            else:
                self.send_json(404, {"detail": "Not Found"})

        def embeddings(self) -> None:
            req = self.read_json()
            if (
                not isinstance(req, dict)
                or req.get("model", engine.served_names[0]) not in engine.served_names
            ):
                self.send_error_json(400, "bad embeddings request", "BadRequestError")
                return
            prompt_tokens = max(1, len(str(req.get("input", "")).split()))
            with engine.lock:
                engine.prompt_tokens += prompt_tokens
                engine.iterations += 1
                engine.successes += 1
            usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
            data = [{"index": 0, "object": "embedding", "embedding": [0.25, -0.5, 0.125]}]
            self.send_json(200, {"object": "list", "data": data, "model": req.get("model"), "usage": usage})

        def completion(self) -> None:
            req = self.read_json()
            if not isinstance(req, dict):
                self.send_error_json(400, "Invalid JSON body", "BadRequestError")
                return
            model = req.get("model", engine.served_names[0])
            if model not in engine.served_names:
                self.send_error_json(404, f"The model `{model}` does not exist.", "NotFoundError")
                return
            if engine.args.fake_refuse_canary and not engine.dead:
                engine.kill_engine("Unsupported CPU attention configuration (fake).")
                engine.exit_later(0.3, 0, "Engine core died; shutting down the API server")
            if engine.dead:
                msg = "EngineCore encountered an issue. See stack trace (above) for the root cause."
                self.send_error_json(500, msg, "InternalServerError")
                return
            max_tokens = int(req.get("max_tokens") or 16)
            prompt_tokens = max(1, len(str(req.get("prompt", "")).split()))
            if engine.hung.is_set():
                # Like a SIGSTOPped vLLM worker: the request never finishes, and the gauges stay
                # frozen at their last values, since they only update on engine outputs.
                threading.Event().wait()  # never answers; the thread is a daemon
            with engine.lock:
                engine.running += 1
            time.sleep(engine.args.fake_completion_delay_s)
            with engine.lock:
                engine.running -= 1
                engine.prompt_tokens += prompt_tokens
                engine.generation_tokens += max_tokens
                engine.iterations += max_tokens
                engine.successes += 1
            self.send_json(
                200,
                {
                    "id": f"cmpl-{uuid.uuid4().hex}",
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": model,
                    "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": "length"}],
                    "usage": {
                        "prompt_tokens": prompt_tokens,
                        "completion_tokens": max_tokens,
                        "total_tokens": prompt_tokens + max_tokens,
                    },
                },
            )

    return Handler


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="fake vLLM API server", allow_abbrev=False)
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", nargs="+", default=None)
    parser.add_argument("--fake-startup-delay-s", type=float, default=0.3)
    # Time spent "loading weights" and "compiling" (logged as vLLM does), on top of the delay.
    parser.add_argument("--fake-load-s", type=float, default=0.0)
    parser.add_argument("--fake-compile-s", type=float, default=0.0)
    parser.add_argument("--fake-refuse-canary", action="store_true")
    parser.add_argument("--fake-crash-after-s", type=float, default=None)
    parser.add_argument("--fake-exit-code", type=int, default=0)
    parser.add_argument("--fake-ignore-sigterm", action="store_true")
    parser.add_argument("--fake-child", action="store_true")
    parser.add_argument("--fake-hold-port", action="store_true", help="accepted and ignored")
    parser.add_argument("--fake-completion-delay-s", type=float, default=0.0)
    parser.add_argument("--fake-oom-above-max-num-seqs", type=int, default=None)
    parser.add_argument("--fake-dev-mode", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-active-seqs", type=int, default=None)  # a warm ladder flag: accepted
    parser.add_argument("--fake-metrics-file", default=None)
    parser.add_argument("--fake-metrics-scale", type=int, default=1)
    parser.add_argument("--fake-metrics-advance", action="store_true")
    parser.add_argument("--fake-scrape-log", default=None)
    parser.add_argument("--fake-step-heartbeat", default=None)
    parser.add_argument("--fake-step-s", type=float, default=0.02)
    parser.add_argument("--fake-cuda-gib", type=float, default=None)
    # Long lines on stdout once serving (issue 38: a 71 MB `logs` reply): COUNT lines of 100 KiB.
    parser.add_argument("--fake-long-lines", type=int, default=0)
    parser.add_argument("--api-key", nargs="+", default=None)
    parser.add_argument("--task", default=None)
    parser.add_argument("--runner", default=None)
    parser.add_argument("--convert", default=None)
    parser.add_argument("--disable-access-log-for-endpoints", default=None)
    args, _ignored = parser.parse_known_args(argv)  # every real vLLM flag is accepted and ignored
    return args


def hold_cuda_memory(engine: FakeEngine, gib: float) -> bool:
    """Hold ``gib`` GiB on CUDA device 0 (the first device ``CUDA_VISIBLE_DEVICES`` shows) and
    record what CUDA says about the devices this process sees. False (logged) when it cannot."""
    try:
        import torch  # only here: the fake is standard library otherwise

        count = torch.cuda.device_count()
        memory = torch.empty(int(gib * 1024**3), dtype=torch.uint8, device="cuda:0")
        memory.zero_()
        torch.cuda.synchronize()
        uuid_text = str(torch.cuda.get_device_properties(0).uuid)
    except Exception as exc:
        log("ERROR", f"--fake-cuda-gib {gib}: {type(exc).__name__}: {exc}")
        return False
    engine.cuda_memory = memory
    engine.cuda.update(
        device_count=count,
        uuid=uuid_text if uuid_text.startswith("GPU-") else "GPU-" + uuid_text,
        held_bytes=memory.numel(),
    )
    log("INFO", f"holding {gib:g} GiB on CUDA device 0 ({engine.cuda['uuid']}) of {count} visible")
    return True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    engine = FakeEngine(args)
    log("WARNING", "This is a fake vLLM server for tests; no model is loaded.")
    log("INFO", f"vLLM API server version {VERSION}")
    log("INFO", f"non-default args: {{'model': {args.model!r}, 'host': {args.host!r}, 'port': {args.port}}}")

    def on_term(signum: int, _frame: object) -> None:
        log("INFO", f"[shutdown] API server: shutdown triggered by signal {signum}")
        engine.exit(0)

    if args.fake_ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)

    if args.fake_oom_above_max_num_seqs is not None and args.max_num_seqs > args.fake_oom_above_max_num_seqs:
        log("ERROR", "EngineCore failed to start.")
        print(
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
            "capacity of 79.19 GiB of which 1.06 GiB is free.",
            file=sys.stderr,
            flush=True,
        )
        return 1
    if args.fake_child:
        engine.spawn_child()
    # vLLM's start milestones (docs/vllm-notes.md §5), which the supervisor reads as phases.
    log("INFO", f"Starting to load model {args.model}...")
    time.sleep(args.fake_load_s)
    if args.fake_cuda_gib is not None and not hold_cuda_memory(engine, args.fake_cuda_gib):
        return 1
    log("INFO", f"Loading weights took {args.fake_load_s:.2f} seconds")
    time.sleep(args.fake_compile_s)
    log("INFO", f"torch.compile took {args.fake_compile_s:.2f} s in total")
    time.sleep(args.fake_startup_delay_s)  # "loading": connections are refused meanwhile
    if args.fake_step_heartbeat:
        # vLLM builds its scheduler (and the plugin its file) before the API server listens.
        FakeSteps(engine, args.fake_step_heartbeat, args.fake_step_s)
    log("INFO", "init engine (profile, create kv cache, warmup model) took 0.00 seconds")
    try:
        server = Server((args.host, args.port), make_handler(engine))
    except OSError as exc:
        log(
            "ERROR",
            f"[Errno {exc.errno}] error while attempting to bind on address ({args.host}, {args.port})",
        )
        engine.exit(1)
    log("INFO", f"Starting vLLM server on http://{args.host}:{args.port}")
    print(f"INFO:     Started server process [{os.getpid()}]", flush=True)  # uvicorn's own format
    print("INFO:     Waiting for application startup.", flush=True)
    print("INFO:     Application startup complete.", flush=True)
    for n in range(args.fake_long_lines):
        print(f"INFO long line {n:05d} " + "x" * 100 * 1024, flush=True)
    if args.fake_long_lines:
        # Alone in the pipe (the daemon forwards an over-long line in pieces of what it has
        # read, which may cut a line after it): a marker the tests can wait for.
        time.sleep(0.5)
        print("INFO long lines done", flush=True)
    if args.fake_crash_after_s is not None:
        engine.exit_later(
            args.fake_crash_after_s, args.fake_exit_code, "fake crash after --fake-crash-after-s"
        )
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
