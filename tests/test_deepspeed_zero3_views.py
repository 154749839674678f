"""A ZeRO-3 restore from memory copies no parameters where the module's partitions share the master's dtype
(an fp32 model): during DeepSpeed's load both views one copy-on-write mapping of the slot, afterwards each has
its own (integrations/deepspeed/handle.py, _share_module_partitions), and training goes on bit-identically.
A real engine on CPU/gloo with a real SMP, in a subprocess (one process group per process)."""
import json
import subprocess
import sys
import textwrap

from ds_harness import free_port

SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import torch, deepspeed
    from inmem_ft.integrations.deepspeed import cpu_setup, install

    cpu_setup()
    deepspeed.init_distributed(dist_backend="gloo")
    BLOCK = {"interval": 3, "job": sys.argv[2]}
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(1))

    def engine():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]

    def train(e, steps):
        losses = []
        for _ in range(steps):
            loss = e(x).pow(2).mean()
            e.backward(loss)
            e.step()
            losses.append(loss.item())
        return losses

    first = engine()
    handle = install(first, config=BLOCK)
    train(first, 3)  # the snapshot of step 3, the only one
    handle.wait()
    master_then = first.optimizer.fp32_partitioned_groups_flat[0].detach().clone()
    expected = train(first, 2)
    handle.close()

    second = engine()
    handle = install(second, config=BLOCK)
    opt, cow = second.optimizer, handle.snap.private_mappings()
    flat, master = opt.fp16_partitioned_groups_flat[0], opt.fp32_partitioned_groups_flat[0]
    start, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    out = {"step": handle.restored.step, "tier": handle.restored.tier,
           "apart": flat.data_ptr() != master.data_ptr(),
           "both_copy_on_write": flat.untyped_storage().data_ptr() in cow and
                                 master.untyped_storage().data_ptr() in cow,
           "buffer_backs_flat": opt.lp_param_buffer.data_ptr() == start and
                                opt.lp_param_buffer.numel() == flat.numel(),
           "params_in_flat": all(start <= p.ds_tensor.data_ptr() < end for p in second.module.parameters()),
           "restored_values": bool(torch.equal(flat, master_then) and torch.equal(master, master_then))}
    out["losses_equal"] = train(second, 2) == expected
    out["flat_is_master_after_steps"] = bool(torch.equal(opt.fp16_partitioned_groups_flat[0],
                                                         opt.fp32_partitioned_groups_flat[0]))
    out["apart_after_steps"] = opt.fp16_partitioned_groups_flat[0].data_ptr() != \\
        opt.fp32_partitioned_groups_flat[0].data_ptr()
    handle.close()
    print("RESULT " + json.dumps(out))
    from inmem_ft.teardown import run_main
    run_main(lambda: None)  # the gloo groups go before the interpreter finalizes (teardown.py)
""")


def test_zero3_fp32_restore_shares_the_masters_bytes_for_the_load_then_parts_them(job, smp):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(free_port()), job], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert (out["step"], out["tier"]) == (3, "memory")
    assert out["apart"] and out["both_copy_on_write"] and out["buffer_backs_flat"] and out["params_in_flat"]
    assert out["restored_values"]
    assert out["losses_equal"] and out["flat_is_master_after_steps"] and out["apart_after_steps"]
