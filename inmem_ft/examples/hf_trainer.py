"""A tiny GPT-2 (built from a config: no model hub) trained by transformers.Trainer with DeepSpeed, protected by
inmem_ft. The inmem_ft lines: the `"inmem_ft"` block in the DeepSpeed config and
`inmem_ft.integrations.huggingface.install(trainer)` before trainer.train(). Run one process per rank with the
torchrun variables set (torchrun, `inmem-ft run`, SimulatedCluster) and an SMP per node; deterministic on CPU."""
import argparse
import json
import os

import torch

import inmem_ft
from inmem_ft.examples.ds_common import add_failure_args, die_if_asked, parse, start

VOCAB, SEQ, SAMPLES = 64, 16, 64


class Tokens(torch.utils.data.Dataset):
    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def ds_config(stage: int, interval: int, hf_optimizer: bool, no_inmem: bool) -> dict:
    conf = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": stage},
            "steps_per_print": 10**9, "inmem_ft": {"enabled": not no_inmem, "interval": interval}}
    if not hf_optimizer:  # DeepSpeed's optimizer and scheduler, filled by the Trainer
        conf["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}}
        conf["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                            "warmup_num_steps": "auto"}}
    return conf


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--zero-stage", type=int, default=2, choices=[2, 3])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--epochs", type=int, default=1, help="with --steps 0: train this many epochs")
    p.add_argument("--interval", type=int, default=4)
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--hf-optimizer", action="store_true", help="the Trainer's AdamW and linear schedule")
    p.add_argument("--no-inmem", action="store_true", help='the block with "enabled": false')
    p.add_argument("--out", default=None, help="rank 0 writes each step's loss, lr and grad norm (JSON lines) "
                                               "and PATH.history, the Trainer's log_history at the end")
    add_failure_args(p)
    args = parse(p)
    start()
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from inmem_ft.integrations.huggingface import install

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))
    training = TrainingArguments(
        output_dir=os.environ.get("INMEM_FT_RUNTIME_DIR", ".") + "/hf-out", per_device_train_batch_size=2,
        gradient_accumulation_steps=args.accumulation, max_steps=args.steps or -1, num_train_epochs=args.epochs,
        learning_rate=3e-3, warmup_steps=5, weight_decay=0.01, logging_steps=3, save_strategy="no",
        report_to="none", disable_tqdm=True, seed=0, use_cpu=True,
        deepspeed=ds_config(args.zero_stage, args.interval, args.hf_optimizer, args.no_inmem))

    class Steps(TrainerCallback):
        """Each step's loss, lr and grad norm on rank 0 (the test compares them with an uninterrupted run's)."""

        def on_log(self, a, state, control, logs=None, **kw):
            self.logged = logs

        def on_step_end(self, a, state, control, **kw):
            engine = trainer.model_wrapped
            inmem_ft.report_loss(state.global_step, trainer.last_loss, args.out,
                                 lr=engine.get_lr()[0], grad_norm=float(engine.get_global_grad_norm()))
            die_if_asked(args, state.global_step, engine.global_rank, adapter.handle if adapter else None)

    class Recorded(Trainer):
        def training_step(self, *a, **kw):
            loss = super().training_step(*a, **kw)
            self.last_loss = float(loss.item())
            return loss

    trainer = Recorded(model=model, args=training, train_dataset=Tokens(1234), callbacks=[Steps()])
    adapter = install(trainer)  # the one inmem_ft line
    trainer.train()
    if args.out and trainer.is_world_process_zero():
        with open(args.out + ".history", "w") as f:
            json.dump(trainer.state.log_history, f)


if __name__ == "__main__":
    from inmem_ft.teardown import run_main

    run_main(main)
