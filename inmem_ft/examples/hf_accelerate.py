"""A tiny GPT-2 (from a config: no model hub) trained by a loop of one's own on accelerate with a DeepSpeed
plugin, protected by inmem_ft: the `"inmem_ft"` block in the DeepSpeed config and
`handle = inmem_ft.integrations.huggingface.install(accelerator, extra_state=...)` after accelerator.prepare.
The loop's position travels in extra_state, which runs inside accelerator.backward() (engine.step()), before
the loop moves its counter: hence `step + 1`."""
import argparse

import torch

import inmem_ft
from inmem_ft.examples.ds_common import add_failure_args, die_if_asked, parse, start
from inmem_ft.examples.hf_trainer import SEQ, VOCAB, Tokens


def arguments() -> argparse.Namespace:
    """This example's arguments, also lightning_gpt.py's."""
    p = argparse.ArgumentParser()
    p.add_argument("--zero-stage", type=int, default=2, choices=[2, 3])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--interval", type=int, default=4)
    p.add_argument("--no-inmem", action="store_true", help='the block with "enabled": false')
    p.add_argument("--out", default=None, help="rank 0 writes each step's loss, lr and grad norm (JSON lines)")
    add_failure_args(p)
    return parse(p)


def main() -> None:
    args = arguments()
    start()
    from accelerate import Accelerator, DeepSpeedPlugin
    from transformers import GPT2Config, GPT2LMHeadModel

    from inmem_ft.integrations.huggingface import install

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": args.zero_stage}, "steps_per_print": 10**9,
              "inmem_ft": {"enabled": not args.no_inmem, "interval": args.interval}}
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))  # cpu=True would drop DeepSpeed
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))
    data = torch.utils.data.DataLoader(Tokens(1234), batch_size=2)
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
    engine = accelerator.deepspeed_engine_wrapped.engine

    step = 0
    # the one inmem_ft line; the scheduler accelerate keeps outside the engine travels with the loop's step
    handle = install(accelerator, extra_state=lambda: {"step": step + 1, "scheduler": scheduler.state_dict()})
    if handle is not None and handle.restored is not None:
        step = handle.restored.extras["step"]
        scheduler.load_state_dict(handle.restored.extras["scheduler"])
    rng = inmem_ft.capture_rng_state()  # the restored one, re-applied once the first batch is in: a
    for batch in accelerator.skip_first_batches(data, step):  # DataLoader's start draws torch's RNG
        if rng is not None:
            inmem_ft.restore_rng_state(rng)
            rng = None
        loss = model(**batch).loss
        accelerator.backward(loss)  # engine.step(): the update, and a snapshot at a snapshot step
        optimizer.step(), scheduler.step(), optimizer.zero_grad()
        step += 1
        inmem_ft.report_loss(step, float(loss.item()), args.out, lr=engine.get_lr()[0],
                             grad_norm=float(engine.get_global_grad_norm()))
        die_if_asked(args, step, engine.global_rank, handle)
        if step == args.steps:
            break
    if handle is not None:
        handle.close()


if __name__ == "__main__":
    from inmem_ft.teardown import run_main

    run_main(main)
