"""A small GPT trained with Megatron-Core's own pretrain() loop and protected by inmem_ft (`--inmem-ft`).

Like Megatron-LM's pretrain_gpt.py, on synthetic data: every Megatron argument works (TP, PP, DP, the
distributed optimizer, --save/--load); the inmem_ft lines are `extra_args_provider=add_args` and
`install(args)`. Run one process per rank with the torchrun variables set (torchrun,
`inmem-ft launch-script torchrun`, `inmem-ft launch`) and an SMP per node, e.g.

    inmem-ft launch --nodes 1 --ranks-per-node 2 --kill-rank 7:1 -- -m inmem_ft.examples.megatron_gpt \\
        --tensor-model-parallel-size 2 --train-iters 12 --inmem-ft --inmem-ft-interval 3

Without CUDA it loads the test-only CPU shim (tests/megatron_cpu_shim.py) and picks the CPU settings
(gloo, the local transformer, no fused kernels). Example-only flags: --loss-log, --die-at/--die-rank,
--lose-node-at N (after iteration N, --die-rank's whole node: its SMP, its agent, itself; ds_common.lose_node;
--die-attempt: the restart both apply to, as torch elastic counts them), --snapshot-at N (handle.snapshot()
in iteration N, whatever the interval), and --dump-state PATH --dump-at N[,N...] or START::EVERY (what the
resharding tests compare: at iteration N, right after a load of it or right after training it, every rank
writes PATH.rank<r>.pt: its parameter and optimizer pieces in model space, with their boxes, and the counters;
"{restart}" in PATH is torch elastic's restart count, "{world}" the world size, "{iteration}" the N).

The data position is Megatron's consumed_train_samples: its pretraining sampler hands global batch b the
samples [b x G, (b+1) x G) of the global order (G = --global-batch-size), split into micro x DP chunks, each
rank its micro-batch of every chunk. A job resumed from iteration s on any DP size trains those same samples
next, in more or fewer micro-batches where the DP size changed (integrations/megatron/batch.py keeps G): no
sample is skipped or repeated in the global order.
"""
from __future__ import annotations

import os
import signal
import sys
from functools import partial

import torch

import inmem_ft.telemetry
from inmem_ft.examples import corrupt
from inmem_ft.examples.ds_common import lose_node

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU = not torch.cuda.is_available()

# A tiny model: the point is the protocol, not the throughput. Any of these can be given on the command line.
DEFAULTS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--lr", "3e-3", "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
            "--lr-decay-iters", "1000", "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--log-interval", "1",
            "--eval-iters", "0", "--eval-interval", "1000000"]
CPU_DEFAULTS = ["--distributed-backend", "gloo", "--transformer-impl", "local", "--use-cpu-initialization",
                "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
                "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm"]


def iterations(text: str):
    """--dump-at's N[,N...] or START::EVERY (START and every EVERY-th iteration after it), as a test of n."""
    if "::" in text:
        start, every = (int(n) for n in text.split("::"))
        return lambda n: n >= start and (n - start) % every == 0
    return {int(n) for n in text.split(",") if n}.__contains__


EXAMPLE_FLAGS = {"--loss-log": str, "--die-at": int, "--die-rank": int, "--die-attempt": int, "--lose-node-at": int,
                 "--dump-state": str, "--dump-at": iterations, "--snapshot-at": int}


def split_argv(argv: list[str]) -> tuple[list[str], dict]:
    """The example's own flags out of the command line; Megatron's parser gets the rest (after the defaults)."""
    own, rest, i = {"loss_log": os.environ.get("INMEM_FT_LOSS_LOG"), "die_at": None, "die_rank": 0,
                    "die_attempt": 0, "lose_node_at": None, "dump_state": None, "dump_at": iterations(""),
                    "snapshot_at": None}, [], 0
    while i < len(argv):
        if argv[i] in EXAMPLE_FLAGS:
            own[argv[i][2:].replace("-", "_")] = EXAMPLE_FLAGS[argv[i]](argv[i + 1])
            i += 2
        else:
            rest.append(argv[i])
            i += 1
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart != own["die_attempt"] or os.environ.get("INMEM_FT_ATTEMPT", "1") != "1":
        own["die_at"] = own["lose_node_at"] = None  # restarted after the injected failure: do not fail again
    if own["dump_state"]:  # one dump per attempt where the path asks (a shrink's restart dumps the restore)
        own["dump_state"] = own["dump_state"].replace("{restart}", str(restart)).replace(
            "{world}", os.environ.get("WORLD_SIZE", "1"))  # a grow or shrink keeps torch's restart count
    return DEFAULTS + (CPU_DEFAULTS if CPU else []) + rest, own


class SyntheticTokens(torch.utils.data.Dataset):
    """Arithmetic token sequences (start, stride): learnable, and sample i is a pure function of i, so the
    data position a resume must bring back is Megatron's consumed_train_samples."""

    def __init__(self, num_samples: int, seq: int, vocab: int, seed: int):
        self.n, self.seq, self.vocab, self.seed = num_samples, seq, vocab, seed
        self.mask = torch.ones(1, seq, seq, dtype=torch.bool).triu(1)  # True = masked (causal)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i))
        start, stride = int(torch.randint(0, self.vocab, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        seq = (start + stride * torch.arange(self.seq + 1)) % self.vocab
        return {"tokens": seq[:-1], "labels": seq[1:], "loss_mask": torch.ones(self.seq),
                "position_ids": torch.arange(self.seq), "attention_mask": self.mask}


def datasets_provider(num_samples, vp_stage=None):
    from megatron.training import get_args

    args = get_args()
    return [SyntheticTokens(n, args.seq_length, args.padded_vocab_size, args.seed + k) if n else None
            for k, n in enumerate(num_samples)]


datasets_provider.is_distributed = True  # every rank builds its own (no TP broadcast of the batch)


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    return GPTModel(config=config or core_transformer_config_from_args(args),
                    transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                    post_process=post_process,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, pg_collection=pg_collection,
                    vp_stage=vp_stage)


def loss_func(loss_mask, output_tensor):
    losses, mask = output_tensor.view(-1).float(), loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    tokens = mask.sum().to(torch.int)
    return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.view(1)])}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def log_metrics(own: dict, handle) -> None:
    """Per iteration: loss and grad norm to the loss log (what the resume tests compare), the heartbeat, and
    the injected failure. Hooks Megatron's training_log, which every rank calls once per iteration."""
    import inmem_ft
    from megatron.training import training

    stock = training.training_log

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                     skipped_iter, grad_norm, *args, **kwargs):
        # On the training device: the default group is NCCL on a GPU, which refuses a host tensor.
        loss = torch.tensor([float(loss_dict["lm loss"]) if "lm loss" in loss_dict else 0.0], dtype=torch.float64,
                            device=torch.accelerator.current_accelerator() if torch.accelerator.is_available()
                            else "cpu")  # torch 2.6's current_accelerator() raises where there is none
        torch.distributed.broadcast(loss, src=torch.distributed.get_world_size() - 1)  # the last stage has it
        if torch.distributed.get_rank() == 0:
            inmem_ft.report_loss(iteration, loss.item(), own["loss_log"], grad_norm=grad_norm, lr=learning_rate)
        if handle is not None:
            handle.snap.heartbeat(step=iteration)
            if iteration == own["snapshot_at"]:
                handle.snapshot()  # every rank, this iteration: a snapshot at its end
        if iteration == own["die_at"] and torch.distributed.get_rank() == own["die_rank"]:
            if handle is not None:
                handle.wait()  # which snapshot survives is then fixed
            os.kill(os.getpid(), signal.SIGKILL)
        if iteration == own["lose_node_at"] and torch.distributed.get_rank() == own["die_rank"]:
            lose_node(handle)
        return stock(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                     skipped_iter, grad_norm, *args, **kwargs)

    training.training_log = training_log


def dump_state(path: str, model, optimizer, scheduler, iteration: int) -> None:
    """This rank's model-space pieces (parameters by their ShardedTensor box; the distributed optimizer's
    fp32 masters and moments by box and flat range) and counters, for a test to assemble global tensors."""
    from megatron.training import get_args

    from inmem_ft.integrations.megatron.layout import dp_slices, model_shards

    args, pieces = get_args(), []
    shards = model_shards(model)
    for sh in shards.values():
        pieces.append({"key": sh.key, "shape": list(sh.global_shape), "offset": list(sh.global_offset),
                       "box": [1] * sh.prepend_axis_num + list(sh.local_shape), "data": sh.data.detach().clone()})
    for opt, _, _, param, span in dp_slices(optimizer):
        sh = shards[id(param)]
        for kind, value in opt._get_main_param_and_optimizer_states(param).items():
            if kind == "step":  # a scalar, in the counters
                continue
            pieces.append({"key": f"optimizer.state.{'fp32_param' if kind == 'param' else kind}.{sh.key}",
                           "shape": list(sh.global_shape), "offset": list(sh.global_offset),
                           "box": [1] * sh.prepend_axis_num + list(sh.local_shape), "flat": [span.start, span.end],
                           "data": value.detach().clone()})
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    # torch's Adam counts in each parameter's state, a fused Adam in its param groups; there torch's keeps the
    # "step" Megatron's load put in (its save writes it from the state), which stays behind as training goes on.
    steps = {float(s["step"]) for o in inner for s in o.state.values() if "step" in s} or \
        {float(g["step"]) for o in inner for g in o.param_groups if "step" in g}
    counters = {"iteration": iteration, "consumed_train_samples": int(args.consumed_train_samples),
                "scheduler": {k: v for k, v in scheduler.state_dict().items() if isinstance(v, (int, float))},
                "steps": sorted(steps)}
    torch.save({"pieces": pieces, "counters": counters}, f"{path}.rank{torch.distributed.get_rank()}.pt")


def dump_hooks(own: dict) -> None:
    """--dump-state: at iteration --dump-at, right after loading it (before train()) or after training it."""
    if own["dump_state"] is None:
        return
    from megatron.training import get_args, training

    live, train, log = {}, training.train, training.training_log

    def dump(iteration):
        if own["dump_at"](iteration):
            dump_state(own["dump_state"].replace("{iteration}", str(iteration)), live["model"], live["optimizer"],
                       live["scheduler"], iteration)

    def train_then(forward_step_func, model, optimizer, opt_param_scheduler, *args, **kwargs):
        live.update(model=model, optimizer=optimizer, scheduler=opt_param_scheduler)
        dump(get_args().iteration)
        return train(forward_step_func, model, optimizer, opt_param_scheduler, *args, **kwargs)

    def training_log(*args, **kwargs):
        out = log(*args, **kwargs)
        dump(args[3])  # the iteration just trained
        return out

    training.train, training.training_log = train_then, training_log


def corrupt_hook() -> None:
    """$INMEM_FT_TEST_CORRUPT_AT (examples/corrupt.py) on the optimizer train() gets."""
    if corrupt.asked() is None:
        return
    from megatron.training import get_args, training

    train = training.train

    def train_then(forward_step_func, model, optimizer, *args, **kwargs):
        inner = getattr(optimizer, "chained_optimizers", [optimizer])[0].optimizer
        corrupt.after_step(inner, torch.distributed.get_rank(), lambda: get_args().curr_iteration + 1)
        return train(forward_step_func, model, optimizer, *args, **kwargs)

    training.train = train_then


def install_cpu_shim() -> None:
    """Without CUDA: the test-only shim that lets Megatron run on the CPU (before megatron is imported)."""
    if CPU:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        import megatron_cpu_shim

        megatron_cpu_shim.install()


def prepare(argv: list[str]):
    """Everything before pretrain(): the CPU shim where needed, Megatron's arguments (with ours), install().
    Returns (args, cfg, handle, the example's own flags)."""
    megatron_argv, own = split_argv(argv)
    install_cpu_shim()
    inmem_ft.telemetry.log_to_stderr()  # Megatron configures the root logger itself
    torch.set_num_threads(1)  # ranks share the cores; also fixes the reduction order

    from inmem_ft.integrations import megatron as inmem_megatron
    from inmem_ft.integrations.megatron import versions  # megatron-core 0.17 builds pretrain()'s config itself

    sys.argv = [sys.argv[0], *megatron_argv]
    args = versions.parse_and_validate_args(extra_args_provider=inmem_megatron.add_args)
    cfg = versions.pretrain_config(args)
    handle = inmem_megatron.install(args)  # the one inmem_ft line (None without --inmem-ft)
    if int(os.environ.get("RANK", "0")) == 0:
        dp = args.data_parallel_size
        print(f"[example] batch global={args.global_batch_size} micro={args.micro_batch_size} "
              f"accumulation={args.global_batch_size // (args.micro_batch_size * dp)} dp={dp}", flush=True)
    return args, cfg, handle, own


def run(cfg) -> None:
    from megatron.core.enums import ModelType

    from inmem_ft.integrations.megatron import versions

    versions.pretrain(cfg, train_valid_test_dataset_provider=datasets_provider, model_provider=model_provider,
                      model_type=ModelType.encoder_or_decoder, forward_step_func=forward_step)


def main() -> None:
    args, cfg, handle, own = prepare(sys.argv[1:])
    log_metrics(own, handle)
    dump_hooks(own)
    corrupt_hook()
    run(cfg)
    if handle is not None:
        handle.close()


def _main_then_teardown() -> None:
    try:
        main()
    finally:  # Megatron's module globals hold its groups: let them go, so run_main can destroy every one
        state = sys.modules.get("megatron.core.parallel_state")
        if state is not None:
            try:
                state.destroy_model_parallel()
            except Exception as e:  # never in place of main's own error
                print(f"megatron_gpt: destroy_model_parallel failed: {e!r}", file=sys.stderr)


if __name__ == "__main__":  # Megatron's torch_dist save spawns processes: keep the guard
    from inmem_ft.teardown import run_main

    run_main(_main_then_teardown)  # the process groups are destroyed on every path (issue 23)
