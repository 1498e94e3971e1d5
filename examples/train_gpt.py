"""Train the example GPT on a docstring corpus with a piper_fx strategy.

    python examples/train_gpt.py                  # 4 ranks: pp=2 x dp=2, ZeRO-3, 1F1B
    python examples/train_gpt.py --nproc 2 --strategy examples/strategies/pp2_dualpipev.json
    python examples/train_gpt.py --experts 4 --strategy examples/strategies/pp2_dp2_ep2_dualpipev.json
    torchrun --nproc-per-node 2 examples/train_gpt.py --strategy examples/strategies/zero3.json
    torchrun --nproc-per-node 2 examples/train_gpt.py --device cuda --strategy examples/strategies/pp2_1f1b.json
    python examples/train_gpt.py --steps 100 --checkpoint-dir ckpt            # saves ckpt/step_50, ckpt/step_100
    python examples/train_gpt.py --steps 200 --checkpoint-dir ckpt --resume   # goes on from step 100

Run plainly, it spawns `--nproc` ranks itself (file rendezvous); under
torchrun (RANK and WORLD_SIZE set) it is one rank. With `--device cuda` each
rank trains on `cuda:LOCAL_RANK` over NCCL (one GPU per rank); on the CPU over gloo. Each rank trains on its
data-parallel shard of the global batch (pipelines split it further into
microbatches, one `piper_fx.annotate("PP")` region per transformer block;
with `--experts`, every block's MLP is a mixture of experts whose expert
computation is a `piper_fx.annotate("EP")` region, shared out over `mesh.ep`);
rank 0 reports the loss averaged over ranks, then a summary per rank (step
time, compute, exposed communication, bytes per collective, peak memory),
writes the ranks' merged Chrome trace of the last step to the debug
directory, and samples text from the gathered weights in a plain
single-process GPT, outside piper_fx.

With `--checkpoint-dir`, every `--checkpoint-every` steps (and after the last)
the model and optimizer are saved with torch.distributed.checkpoint
(`piper_fx.save_checkpoint`) into DIR/step_N; `--resume` loads the newest one
first and trains on from its step, with any strategy (the checkpoint is
resharded for the one given).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Runnable from a checkout without `pip install`: `piper_fx` and `examples` import from ROOT.
sys.path.insert(0, str(ROOT))
# Set before torch is imported, so every rank (and every run) shares one Inductor
# cache: after the first run, compiling costs seconds instead of a minute.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".inductor_cache"))

import argparse
import json
import resource
import statistics
import tempfile
import time
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import piper_fx
from examples.data import CharTokenizer, batches, load_corpus
from examples.gpt import GPT, GPTConfig

LEARNING_RATE = 3e-3
PRINT_EVERY = 25
LOSS_WINDOW = 50
COLLECTIVE_TIMEOUT = timedelta(seconds=120)
SAMPLE_PROMPT = "Return the "
SAMPLE_CHARS = 200
SAMPLE_TEMPERATURE = 0.8


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=positive_int, default=4,
                        help="ranks to spawn (ignored under torchrun, which sets the world size)")
    parser.add_argument("--strategy", type=Path,
                        default=ROOT / "examples" / "strategies" / "pp2_dp2_zero3_1f1b.json",
                        help="JSON file of piper_fx options (examples/strategies/ has one per preset)")
    parser.add_argument("--n-layer", type=positive_int, default=2,
                        help="transformer blocks (raised to the number of pipeline stages)")
    parser.add_argument("--experts", type=int, default=0,
                        help="experts per MoE layer (top-2 routed); 0 for the dense GPT")
    parser.add_argument("--steps", type=positive_int, default=300)
    parser.add_argument("--debug-dir", default="piper_debug", help="where piper_fx writes its debug dumps")
    parser.add_argument("--codegen", choices=["inductor", "eager"], help="overrides the strategy's codegen")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: rank r on cuda:LOCAL_RANK over NCCL (one GPU per rank); cpu: gloo")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="global batch, split over dp ranks")
    parser.add_argument("--block-size", type=positive_int, default=64, help="tokens per sequence")
    parser.add_argument("--checkpoint-dir", type=Path, help="save DIR/step_N checkpoints (torch.distributed.checkpoint)")
    parser.add_argument("--checkpoint-every", type=positive_int, default=50, help="steps between checkpoints")
    parser.add_argument("--resume", action="store_true", help="start from the newest checkpoint in --checkpoint-dir")
    args = parser.parse_args()
    if args.resume and args.checkpoint_dir is None:
        parser.error("--resume needs --checkpoint-dir")
    return args


def newest_checkpoint(directory: Path) -> Path | None:
    steps = [(int(path.name.removeprefix("step_")), path) for path in directory.glob("step_*")
             if path.name.removeprefix("step_").isdigit() and (path / ".metadata").exists()]
    return max(steps)[1] if steps else None


def strategy_options(args: argparse.Namespace, world_size: int) -> dict:
    """The strategy file's options, completed by the command line."""
    options = json.loads(args.strategy.read_text())
    mesh = options.setdefault("mesh", {})
    mesh.setdefault("dp", world_size // mesh.get("pp", 1))
    if args.codegen is not None:
        options["codegen"] = args.codegen
    # Time the collective waits inside tasks, for the summary's exposed communication.
    options.setdefault("profile", True)
    options["debug_dir"] = os.path.abspath(args.debug_dir)
    return options


def sample(state: dict[str, torch.Tensor], cfg: GPTConfig, tokenizer: CharTokenizer,
           prompt_tokens: torch.Tensor, length: int) -> torch.Tensor:
    """Continue the prompt by sampling from a plain eager GPT loaded with `state`."""
    model = GPT(cfg)
    model.load_state_dict(state)
    model.eval()
    # GPT.forward returns only the loss; the next-token logits are taken from lm_head.
    last_logits: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda module, inputs, output: last_logits.append(output[0, -1]))
    generator = torch.Generator().manual_seed(0)
    tokens = prompt_tokens
    with torch.no_grad():
        for _ in range(length):
            context = tokens[-cfg.block_size:].unsqueeze(0)
            model(context, torch.zeros_like(context))
            probs = torch.softmax(last_logits.pop() / SAMPLE_TEMPERATURE, dim=-1)
            tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=generator)])
    return tokens


def eval_loss(state: dict[str, torch.Tensor], cfg: GPTConfig, x: torch.Tensor, y: torch.Tensor) -> float:
    """The loss of a plain eager GPT loaded with `state`: checks the gathered weights are the trained ones."""
    model = GPT(cfg)
    model.load_state_dict(state)
    with torch.no_grad():
        return model(x, y).item()


def rank_device(args: argparse.Namespace) -> torch.device:
    """Where this rank trains: its own GPU (`cuda:LOCAL_RANK`), or the CPU."""
    if args.device == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def train(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """One rank's training run; expects the process group to be initialized."""
    device = rank_device(args)
    if device.type == "cpu":
        # Two cores shared by all ranks: more intra-op threads only oversubscribe them.
        torch.set_num_threads(1)
    text = load_corpus()
    tokenizer = CharTokenizer(text)
    tokens = tokenizer.encode(text)
    options = strategy_options(args, world_size)
    strategy = piper_fx.parse_options(options)

    # One PP region per block, so each stage of the pipeline holds whole blocks.
    stages = strategy.pp * strategy.stages_per_rank
    cfg = GPTConfig(vocab_size=len(tokenizer), block_size=args.block_size, n_layer=max(args.n_layer, stages),
                    n_head=4, n_embd=64, n_expert=args.experts)
    torch.manual_seed(0)  # every rank builds the same initial weights
    model = GPT(cfg).to(device)
    if strategy.pp > 1:
        model.block_context = lambda: piper_fx.annotate("PP")
    if args.experts:
        model.expert_context = lambda: piper_fx.annotate("EP")
        for experts in model.experts():
            piper_fx.mark_experts(experts)
    piper_fx.prepare(model, options)
    # Fused: one kernel over the parameters' local tensors (a for-loop AdamW runs each op
    # through DTensor's dispatch, README).
    opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, fused=True)
    first = 0
    if args.resume:
        checkpoint = newest_checkpoint(args.checkpoint_dir)
        if checkpoint is None:
            raise SystemExit(f"--resume: no checkpoint in {args.checkpoint_dir}")
        first = piper_fx.load_checkpoint(checkpoint, model, opt)  # collective
        if first >= args.steps:
            raise SystemExit(f"--resume: {checkpoint} is at step {first}, not before --steps {args.steps}")
        if rank == 0:
            print(f"resumed from {checkpoint} (step {first})", flush=True)
    step = torch.compile(model, backend="piper", options=options)

    if rank == 0:
        print(f"{world_size} ranks, options {options}\ncorpus {len(text)} chars, vocab {len(tokenizer)}, "
              f"global batch {args.batch_size} x {args.block_size} tokens", flush=True)
    losses: list[float] = []
    step_stats: list[dict] = []
    start = last_time = time.perf_counter()
    last_step = first
    for i in range(first, args.steps):
        x, y = batches(tokens, args.batch_size, args.block_size, i, strategy.dp_index, strategy.dp)
        loss = step(x.to(device), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()

        # Each rank's loss is its replica's shard mean; equal shards make the
        # mean over ranks the loss of the global batch.
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world_size)
        step_stats.append(piper_fx.last_step_stats())
        done = i + 1
        if done == first + 1:
            first_step_s = time.perf_counter() - start
        # Step 1 is reported too: its time is mostly compilation.
        if rank == 0 and (done == first + 1 or done % PRINT_EVERY == 0 or done == args.steps):
            now = time.perf_counter()
            tokens_per_s = (done - last_step) * args.batch_size * args.block_size / (now - last_time)
            print(f"step {done:5d}  loss {losses[-1]:.4f}  {tokens_per_s:8.0f} tokens/s  "
                  f"{now - start:7.1f}s elapsed", flush=True)
            last_time, last_step = now, done
        if args.checkpoint_dir is not None and (done % args.checkpoint_every == 0 or done == args.steps):
            saved = args.checkpoint_dir / f"step_{done}"
            piper_fx.save_checkpoint(saved, model, opt, step=done)  # collective
            if rank == 0:
                print(f"checkpoint: {saved}", flush=True)
    total_s = time.perf_counter() - start
    steps_run = args.steps - first

    state = piper_fx.full_state_dict(model)  # collective: every rank takes part
    summaries: list = [None] * world_size
    dist.all_gather_object(summaries, rank_summary(rank, strategy, step_stats[1:] or step_stats))
    traces: list = [None] * world_size
    dist.all_gather_object(traces, piper_fx.last_step_trace())
    if rank != 0:
        return
    print_summary(summaries, args.batch_size * args.block_size)
    trace_path = Path(options["debug_dir"]) / "trace.json"
    trace_path.write_text(json.dumps({"traceEvents": [e for t in traces for e in t["traceEvents"]]}))
    print(f"trace of the last step, all ranks: {trace_path} (open in ui.perfetto.dev or chrome://tracing)")
    pictures = sorted(Path(options["debug_dir"]).glob("rank0/graph*/schedule.svg"))
    if strategy.pp > 1 and pictures:
        print(f"schedule picture: {pictures[-1]}")
    window = max(1, min(LOSS_WINDOW, steps_run // 2))
    print(f"mean loss: first {window} steps {statistics.fmean(losses[:window]):.4f} -> "
          f"last {window} steps {statistics.fmean(losses[-window:]):.4f}")
    steady = f", then {(total_s - first_step_s) / (steps_run - 1) * 1000:.0f} ms/step" if steps_run > 1 else ""
    print(f"total time {total_s:.1f}s for {steps_run} steps (first step {first_step_s:.1f}s with compilation{steady})")
    print(f"rank 0's {piper_fx.last_compile_stats()['summary']} (compile_stats.txt in the dumps)")
    print(f"debug dumps: {options['debug_dir']}")
    # A global batch no step trained on, through plain single-process PyTorch.
    x, y = batches(tokens, args.batch_size, args.block_size, args.steps, 0, 1)
    print(f"gathered weights in a single-process GPT: loss {eval_loss(state, cfg, x, y):.4f} on an unseen batch")
    text = tokenizer.decode(sample(state, cfg, tokenizer, tokenizer.encode(SAMPLE_PROMPT), SAMPLE_CHARS))
    print(f"sample (temperature {SAMPLE_TEMPERATURE}):\n{text}", flush=True)


def rank_summary(rank: int, strategy, stats: list[dict]) -> dict:
    """Medians of this rank's step stats (after the first, compiling, step) and its peak memory."""
    def median(key: str) -> float:
        return statistics.median(s[key] for s in stats)
    return {"rank": rank, "pp": strategy.pp_index, "dp": strategy.dp_index, "step_s": median("step_s"),
            "compute_s": median("compute_s"), "comm_wait_s": median("comm_wait_s"),
            "exposed": median("exposed_comm_fraction"), "comm_bytes": stats[-1]["comm_bytes"],
            "peak_activation_bytes": max(s["peak_activation_bytes"] for s in stats),
            "memory": stats[-1]["memory"], "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def print_summary(summaries: list[dict], tokens_per_step: int) -> None:
    slowest = max(s["step_s"] for s in summaries)
    print(f"summary (medians over steps after the first): {tokens_per_step / slowest:.0f} tokens/s "
          f"at {slowest * 1000:.1f} ms/step (the slowest rank's program)")
    print(f"{'rank':>4} {'pp':>3} {'dp':>3} {'step ms':>8} {'compute ms':>11} {'comm wait ms':>13} "
          f"{'exposed':>8} {'activations KB':>15} {'max RSS MB':>11}  bytes per step")
    for s in summaries:
        sent = ", ".join(f"{kind} {nbytes / 1024:.0f} KB" for kind, nbytes in sorted(s["comm_bytes"].items()))
        print(f"{s['rank']:4d} {s['pp']:3d} {s['dp']:3d} {s['step_s'] * 1e3:8.1f} {s['compute_s'] * 1e3:11.1f} "
              f"{s['comm_wait_s'] * 1e3:13.1f} {s['exposed']:8.0%} {s['peak_activation_bytes'] / 1024:15.0f} "
              f"{s['max_rss_mb']:11.0f}  {sent}")
    parts = [part for part in summaries[0]["memory"] if part != "peak"]
    print("where each rank's memory goes at its step's peak, KB (last_step_stats()['memory']):")
    print(f"{'rank':>4} " + " ".join(f"{part.replace('_', ' '):>{max(len(part), 8)}}" for part in parts) + f" {'= peak':>8}")
    for s in summaries:
        memory = s["memory"]
        print(f"{s['rank']:4d} " + " ".join(f"{memory[part] / 1024:{max(len(part), 8)}.0f}" for part in parts)
              + f" {memory['peak'] / 1024:8.0f}")


def run_rank(rank: int, world_size: int, init_method: str, args: argparse.Namespace) -> None:
    if args.device == "cuda":
        torch.cuda.set_device(rank_device(args))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT)
    try:
        train(rank, world_size, args)
    finally:
        dist.destroy_process_group()


def spawned_rank(rank: int, world_size: int, init_method: str, args: argparse.Namespace) -> None:
    # What torchrun would set; piper_fx checks the launched world size against the group's.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    run_rank(rank, world_size, init_method, args)


def spawn_ranks(args: argparse.Namespace) -> str | None:
    """Run `args.nproc` ranks to completion; on the first failure stop the rest and say which rank failed."""
    load_corpus()  # build the cache here, once, rather than in every rank
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        init_method = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [ctx.Process(target=spawned_rank, args=(rank, args.nproc, init_method, args), name=f"rank{rank}")
                 for rank in range(args.nproc)]
        for proc in procs:
            proc.start()
        try:
            running = dict(enumerate(procs))
            while running:
                wait([proc.sentinel for proc in running.values()])
                for rank, proc in list(running.items()):
                    if proc.exitcode is None:
                        continue
                    del running[rank]
                    if proc.exitcode != 0:
                        # Its peers would otherwise wait in a collective until the timeout.
                        return f"rank {rank} failed with exit code {proc.exitcode}; stopped the other ranks"
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
            for proc in procs:
                proc.join()
    return None


def main() -> None:
    args = parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", args)
    else:
        sys.exit(spawn_ranks(args))


if __name__ == "__main__":
    main()
