"""A tiny GPT-2 (from a config: no model hub) trained by lightning.Trainer with DeepSpeed, protected by inmem_ft:
the `"inmem_ft"` block in the DeepSpeed config and `strategy=InmemFTStrategy(config=...)` in place of
DeepSpeedStrategy. Run one process per rank with the torchrun variables set (torchrun, `inmem-ft run`,
SimulatedCluster) and an SMP per node; deterministic on CPU."""
import os

import torch

import inmem_ft
from inmem_ft.examples.ds_common import die_if_asked, start
from inmem_ft.examples.hf_accelerate import arguments
from inmem_ft.examples.hf_trainer import SEQ, VOCAB, Tokens


def main() -> None:
    args = arguments()
    start()
    import lightning
    from transformers import GPT2Config, GPT2LMHeadModel

    from inmem_ft.integrations.lightning import InmemFTStrategy

    class GPT(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                                    n_head=2))

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def train_dataloader(self):
            return torch.utils.data.DataLoader(Tokens(1234), batch_size=2, shuffle=True)

    class Steps(lightning.Callback):
        """Each step's loss, lr and grad norm on rank 0 (the test compares them with an uninterrupted run's)."""

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            engine = strategy.deepspeed_engine
            inmem_ft.report_loss(trainer.global_step, float(outputs["loss"].item()), args.out,
                                 lr=engine.get_lr()[0], grad_norm=float(engine.get_global_grad_norm()))
            die_if_asked(args, trainer.global_step, engine.global_rank, strategy.handle)

    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": args.zero_stage},
              "steps_per_print": 10**9,
              "inmem_ft": {"enabled": not args.no_inmem, "interval": args.interval}}
    strategy = InmemFTStrategy(config=config)  # the one inmem_ft line, in place of DeepSpeedStrategy(config=...)
    trainer = lightning.Trainer(
        accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), num_nodes=1, strategy=strategy,
        max_steps=args.steps, callbacks=[Steps()], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0)
    trainer.fit(GPT())


if __name__ == "__main__":
    from inmem_ft.teardown import run_main

    run_main(main)
