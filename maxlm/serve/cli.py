"""``python -m maxlm.serve --checkpoint PATH``: the OpenAI-compatible server, from a checkpoint.

Opens the model (``maxlm.hf.load``), builds the engine, compiles the decode step for every batch
bucket (so the first requests do not wait for compiles), prints one ready line and serves until
SIGTERM or Ctrl-C, which drain: no new connections, requests in flight finish, then exit 0. A
mistake in the command line or the checkpoint is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path

EXAMPLES = """\
examples:
  # serve a run's newest checkpoint on localhost:8000
  python -m maxlm.serve --checkpoint runs/tiny

  # an exported Hugging Face directory, on every interface, behind a key, as "tiny"
  MAXLM_API_KEY=secret python -m maxlm.serve --checkpoint exported/ --host 0.0.0.0 --served-model-name tiny

  # then, with the openai client (or curl):
  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "runs/tiny", "prompt": "def ", "max_tokens": 16, "temperature": 0}'

The served model name is the --checkpoint argument as given (as vLLM does) unless
--served-model-name says otherwise. GET /metrics gives Prometheus metrics; GET /health is 200 while
serving and 503 while draining.
"""


class UserError(Exception):
    """A mistake in the command line or its inputs: one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"maxlm.serve: error: {' '.join(message.split())} (see --help)\n")


def _int(low: int, high: int | None = None):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text} must lie in [{low}, {high}]" if high is not None
                                             else f"{text} must be >= {low}")
        return value
    return parse


def _tensor(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'auto' nor an integer >= 1")
    return int(text)


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be >= 0")
    return value


def parser() -> argparse.ArgumentParser:
    from maxlm.serve.engine import EngineConfig

    d = EngineConfig()
    p = _Parser(prog="python -m maxlm.serve", description=__doc__.splitlines()[0].split(": ", 1)[1],
                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="RUN_DIR|CKPT_DIR|HF_DIR",
                   help="a maxlm run directory (its newest good checkpoint, or --step), one checkpoint "
                        "RUN_DIR/checkpoints/STEP, or a Hugging Face directory")
    p.add_argument("--adapter", metavar="PEFT_DIR",
                   help="LoRA adapters in PEFT's format to put on the checkpoint (e.g. from "
                        "`maxlm.hf export --lora peft`, or trained with Hugging Face PEFT)")
    p.add_argument("--step", type=_int(0), help="the checkpoint step of a run directory (default: the newest good one)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="compute dtype (default: the checkpoint's)")
    p.add_argument("--tensor", type=_tensor, default="auto",
                   help="devices on the tensor axis, or 'auto' (default): 1 on a GPU; on a CPU, one per core "
                        "(as many as the heads divide by), which serves ~25%% more tokens/s at 32 requests "
                        "on 2 cores and costs ~25%% per token for a single stream (then pass --tensor 1)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this machine only)")
    p.add_argument("--port", type=_int(0, 65535), default=8000, help="port (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("MAXLM_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $MAXLM_API_KEY, else none)")
    p.add_argument("--served-model-name", metavar="NAME", help="the model name clients send (default: --checkpoint)")
    p.add_argument("--chat-template", metavar="FILE.jinja",
                   help="Jinja chat template (default: the checkpoint's tokenizer_config.json chat_template, "
                        "else maxlm/data/chat_template.jinja)")
    p.add_argument("--max-num-seqs", type=_int(1), default=d.max_num_seqs,
                   help="requests decoded together at most (default: %(default)s)")
    p.add_argument("--max-queue", type=_int(1), default=d.max_queue,
                   help="requests waiting at most; more get 429 (default: %(default)s)")
    p.add_argument("--batch-wait-ms", type=_non_negative_float, default=d.batch_wait_ms,
                   help="an idle server waits this long after a request for more to batch with "
                        "(default: %(default)s; the guides suggest 50-100 under bursty load)")
    p.add_argument("--block-size", type=_int(1), default=d.block_size, help="tokens per KV block (default: %(default)s)")
    p.add_argument("--num-blocks", type=_int(2), help="KV blocks in the pool (default: room for --max-num-seqs full contexts)")
    p.add_argument("--max-prefill-tokens", type=_int(1), default=d.max_prefill_tokens,
                   help="prompt tokens computed per engine step; longer prompts are chunked (default: %(default)s)")
    p.add_argument("--prefill-chunk", type=_int(1), default=d.prefill_chunk,
                   help="tokens per row of a prefill call; a prompt spans several rows (default: %(default)s)")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not share KV blocks between equal prompt prefixes")
    p.add_argument("--no-warmup", action="store_true", help="compile on first use instead of before serving")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")
    return p


def _chat_template(args: argparse.Namespace) -> str | None:
    if args.chat_template:
        try:
            return Path(args.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(f"{args.chat_template}: cannot read the --chat-template file ({err})") from None
    root = Path(args.checkpoint)
    config = root / "tokenizer_config.json"
    if config.is_file():
        try:
            template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError) as err:
            raise UserError(f"{config}: cannot be read ({err})") from None
        if isinstance(template, str):
            return template
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text(encoding="utf-8")
    return None


def _check_listen(host: str, port: int) -> None:
    """Fail before the model loads when the address cannot be listened on (in use, or not an
    address of this machine), rather than after minutes of compiling."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise UserError(f"--host {host}: not an address this machine can listen on ({err.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as err:
            raise UserError(f"cannot listen on {host}:{port} ({err.strerror})") from None


def serve(args: argparse.Namespace) -> int:
    _check_listen(args.host, args.port)
    chat_template = _chat_template(args)
    from maxlm.hf.load import LoadError, load_model
    from maxlm.infer.placement import use_cpu_cores
    from maxlm.serve.engine import Engine, EngineConfig

    use_cpu_cores()  # (before jax starts) a CPU host's cores as devices: --tensor auto uses them
    try:
        loaded = load_model(args.checkpoint, step=args.step, dtype=args.dtype,
                            tensor=None if args.tensor == "auto" else args.tensor,
                            adapter=args.adapter)
    except LoadError as err:
        raise UserError(str(err)) from None
    config = EngineConfig(max_num_seqs=args.max_num_seqs, block_size=args.block_size, num_blocks=args.num_blocks or 0,
                          max_prefill_tokens=args.max_prefill_tokens,
                          prefill_chunk=args.prefill_chunk, batch_wait_ms=args.batch_wait_ms,
                          max_queue=args.max_queue, prefix_caching=not args.no_prefix_caching)
    problem = config.problem(loaded.cfg)
    if problem:
        raise UserError(problem)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine = Engine(loaded.cfg, loaded.params, loaded.tokenizer, config, mesh=loaded.mesh)
    name = args.served_model_name or args.checkpoint
    if not args.no_warmup:
        print(f"maxlm.serve: compiling the decode step for {len(engine.decode_buckets())} batch sizes ...",
              file=sys.stderr, flush=True)
        seconds = engine.warmup()
        print(f"maxlm.serve: compiled in {seconds:.1f} s", file=sys.stderr, flush=True)

    import uvicorn

    from maxlm.serve.api import build_app

    app = build_app(engine, name, api_key=args.api_key, chat_template=chat_template)
    engine.start()
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=None))
    blocks = engine.blocks.num_blocks - 1
    print(f"maxlm.serve: serving {name!r} ({loaded.source}) on http://{args.host}:{args.port}; "
          f"{blocks} KV blocks of {config.block_size} tokens, up to {config.max_num_seqs} requests at once, "
          f"tensor-parallel over {loaded.mesh.shape['tensor']} {loaded.mesh.devices.flat[0].platform.upper()} device(s)"
          f"{', API key required' if args.api_key else ''}", file=sys.stderr, flush=True)
    # uvicorn handles SIGTERM and SIGINT while it serves (stop listening, finish open requests) and
    # raises them again once done; these no-op handlers make that a clean return (exit 0).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()  # returns after SIGTERM / Ctrl-C, once open requests have finished
    except SystemExit:  # uvicorn could not start (its log line says why), e.g. the port was taken meanwhile
        raise UserError(f"could not listen on {args.host}:{args.port} (see the line above)") from None
    finally:
        engine.shutdown(drain=True)
    if not server.started:
        raise UserError(f"could not start serving on {args.host}:{args.port} (see the lines above)")
    print("maxlm.serve: drained and stopped", file=sys.stderr, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return serve(args)
    except UserError as err:
        print(f"maxlm.serve: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
