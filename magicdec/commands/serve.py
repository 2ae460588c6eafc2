"""`magicdec serve`: the OpenAI-compatible HTTP server (under torchrun rank 0 serves, the others follow)."""

import sys
from pathlib import Path

from magicdec.autoplan import describe
from magicdec.cli import llm_options
from magicdec.commands.generate import speculative_from_args
from magicdec.distributed.serving import StepMirror, follow
from magicdec.engine import LLM
from magicdec.errors import OutOfMemoryError
from magicdec.loading import chat_template, pad_token_id
from magicdec.server.app import build_app, run_server
from magicdec.server.async_engine import AsyncEngine
from magicdec.server.metrics import ServerMetrics


def run(args) -> int:
    llm = LLM(args.model, **llm_options(args), max_num_seqs=args.max_running, max_model_len=args.max_model_len)
    max_len = llm.max_model_len
    # The engine plans --draft auto for its shape, where the KV cache weighs most (every slot full at the longest
    # context): if drafting pays anywhere within the server's limits it pays there; each step then re-plans for its
    # live batch and context (plain decoding where drafting does not pay).
    spec = speculative_from_args(args, llm)
    try:
        engine = llm.engine(spec, max_prefill_tokens=args.prefill_chunk, max_queued=args.max_queued)
    except OutOfMemoryError as e:
        raise OutOfMemoryError(f"{e} (or lower --kv-cache-gb / --max-running / --max-model-len)") from None
    graphs = engine.capture_graphs()
    if graphs.cuda_graphs:
        print(f"magicdec serve: captured {graphs.cuda_graphs} CUDA graphs of the decode step in "
              f"{graphs.graph_capture_s:.1f} s ({graphs.graph_memory_bytes / 2**20:.0f} MiB; --enforce-eager for none)",
              file=sys.stderr, flush=True)
    auto = llm.last_auto
    running = auto.speculative if auto is not None else spec  # what auto chose, or the drafter asked for
    draft = describe(auto.plan) if auto is not None else spec.draft if spec is not None else "none"
    tp = llm.model.tp
    if tp is not None and not tp.is_main:  # rank 0 serves; the others follow its engine turn by turn
        follow(engine, tp)
        return 0
    source = llm.loaded.source
    name = args.served_model_name or args.model or Path(source).name.split(".")[0]
    metrics = ServerMetrics(name, running.draft if running is not None else "none",
                            running.budget if running is not None else None)

    def ready() -> None:
        print(f"magicdec serve: ready on http://{args.host}:{args.port}/v1 (model {name}; up to {args.max_running} "
              f"requests of {max_len} tokens, KV blocks for {llm.kv.capacity_tokens} tokens; draft {draft})", file=sys.stderr, flush=True)

    def stopped() -> None:
        print("magicdec serve: stopped", file=sys.stderr, flush=True)

    mirror = StepMirror(tp) if tp is not None else None
    app = build_app(AsyncEngine(engine, metrics, mirror), llm.tokenizer, metrics, model_name=name, model_root=source,
                    chat_template=chat_template(source), api_key=args.api_key,
                    max_request_bytes=args.max_request_bytes, pad_token_id=pad_token_id(source), on_ready=ready,
                    on_stopped=stopped)
    run_server(app, args.host, args.port, log_level=args.log_level)
    return 0
