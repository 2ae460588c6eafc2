"""`magicdec bench`: the sweep of `magicdec.bench` over the grid the command line gives."""

from magicdec.bench import BenchGrid, run_bench


def run(args) -> int:
    positions = [None if p == "default" else p for p in args.positions.split(",")]
    run_bench(args, BenchGrid(batches=args.batch, contexts=args.context, drafters=args.drafters.split(","),
                              budgets=args.budget, gammas=args.gamma, modes=args.modes.split(","),
                              new_tokens=args.max_tokens, n_texts=args.num_texts,
                              distinct_prompts=args.distinct_prompts, positions=positions,
                              draft_vocabs=args.draft_vocab, vocab_corpus=args.vocab_corpus or args.corpus,
                              draft_stops=args.draft_stop, repeats=args.repeats))
    return 0
