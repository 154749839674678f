"""Stand-alone: stock Megatron-Core `pretrain()` with `--load DIR` (dist_checkpointing, torch_dist), on
the layout its arguments give, on CPU through tests/megatron_cpu_shim.py. Right after Megatron's load it
compares every model ShardedTensor and every optimizer-state ShardedTensor the rank holds with the same box of
a ground-truth file of global tensors, then lets training go on to --train-iters. Never imports inmem_ft.

    python tests/megatron_dist_load.py --truth full.pt --result out.json <Megatron arguments, --load DIR among them>

One process per rank with the torchrun variables set; rank 0 writes the result.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_cpu_shim  # noqa: E402  (before megatron)

megatron_cpu_shim.install()

import torch  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    """Sample i is a pure function of i (the example's synthetic data)."""

    def __init__(self, n, seq, vocab, seed):
        self.n, self.seq, self.vocab, self.seed = n, seq, vocab, seed
        self.mask = torch.ones(1, seq, seq, dtype=torch.bool).triu(1)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i))
        start = int(torch.randint(0, self.vocab, (1,), generator=g))
        stride = int(torch.randint(1, 4, (1,), generator=g))
        seq = (start + stride * torch.arange(self.seq + 1)) % self.vocab
        return {"tokens": seq[:-1], "labels": seq[1:], "loss_mask": torch.ones(self.seq),
                "position_ids": torch.arange(self.seq), "attention_mask": self.mask}


def datasets(num_samples, vp_stage=None):
    from megatron.training import get_args

    args = get_args()
    return [Tokens(n, args.seq_length, args.padded_vocab_size, args.seed + k) if n else None
            for k, n in enumerate(num_samples)]


datasets.is_distributed = True


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


def forward_step(data_iterator, model):
    from functools import partial

    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])

    def loss_func(mask, out):
        loss, tokens = torch.sum(out.view(-1).float() * mask.view(-1)), mask.sum().to(torch.int)
        return loss, tokens, {"lm loss": torch.cat([loss.detach().view(1), tokens.view(1)])}

    return output, partial(loss_func, batch["loss_mask"])


def box(truth: dict, sh) -> torch.Tensor:
    """The piece of the global tensor a ShardedTensor names (its prepended axes are one layer each)."""
    n = sh.prepend_axis_num
    index = tuple(slice(o, o + 1) for o in sh.global_offset[:n]) + tuple(
        slice(o, o + s) for o, s in zip(sh.global_offset[n:], sh.local_shape))
    return truth[sh.key][index].reshape(sh.local_shape)


def compare(truth: dict, shards) -> tuple[int, list[str]]:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    checked, bad = 0, []
    for sh in shards:
        if isinstance(sh, ShardedTensor) and sh.data is not None and sh.key in truth:
            checked += 1
            if not torch.equal(sh.data.detach().reshape(sh.local_shape), box(truth, sh)):
                bad.append(sh.key)
    return checked, bad


def main() -> None:
    argv = sys.argv[1:]
    truth_path, result = argv[argv.index("--truth") + 1], argv[argv.index("--result") + 1]
    for flag in ("--truth", "--result"):
        i = argv.index(flag)
        del argv[i: i + 2]
    torch.set_num_threads(1)
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.enums import ModelType
    from megatron.core.utils import unwrap_model
    from megatron.training import get_args, pretrain, training

    sys.argv = [sys.argv[0], *argv]
    try:  # from 0.18 the entry script parses the arguments and hands pretrain() a config built from them
        from megatron.training.argument_utils import pretrain_cfg_container_from_args
        from megatron.training.arguments import parse_and_validate_args
    except ImportError:  # 0.17: pretrain() parses them itself
        cfg = ()
    else:
        cfg = (pretrain_cfg_container_from_args(parse_and_validate_args(args_defaults={}), None),)
    truth = torch.load(truth_path, weights_only=True)
    out = {}
    setup = training.setup_model_and_optimizer

    def checked_setup(*a, **kw):
        model, optimizer, scheduler = setup(*a, **kw)
        args = get_args()
        model_sd = {}
        for i, chunk in enumerate(unwrap_model(model)):
            model_sd[i] = chunk.sharded_state_dict()
        n_model, bad_model = compare(truth, nested_values(model_sd))
        opt_sd = optimizer.sharded_state_dict(model_sd[0] if len(model_sd) == 1 else model_sd, is_loading=False)
        n_opt, bad_opt = compare(truth, nested_values(opt_sd))
        out.update(iteration=int(args.iteration), consumed=int(args.consumed_train_samples), model_checked=n_model,
                   optimizer_checked=n_opt, mismatched=bad_model + bad_opt)
        return model, optimizer, scheduler

    stock_log = training.training_log

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, *a, **kw):
        out.setdefault("trained", []).append(int(iteration))
        return stock_log(loss_dict, total_loss_dict, learning_rate, iteration, *a, **kw)

    training.setup_model_and_optimizer, training.training_log = checked_setup, training_log
    pretrain(*cfg, train_valid_test_dataset_provider=datasets, model_provider=model_provider,
             model_type=ModelType.encoder_or_decoder, forward_step_func=forward_step)
    counts = torch.tensor([out["model_checked"], out["optimizer_checked"], len(out["mismatched"])])
    torch.distributed.all_reduce(counts)
    if torch.distributed.get_rank() == 0:
        out.update(model_checked=int(counts[0]), optimizer_checked=int(counts[1]), mismatched_total=int(counts[2]),
                   imported_inmem_ft=any(m.split(".")[0] == "inmem_ft" for m in sys.modules))
        with open(result, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
