"""DDP comm hooks of the netbench baselines that torch ships but refuses on gloo.

``bf16_hook``: torch's ``default_hooks.bf16_compress_hook`` computed the same way (the bucket cast to bf16 and
divided by the world size, one all-reduce of the bf16 tensor, the result copied back into the fp32 bucket). torch's
own hook raises on a process group without NCCL 2.10+ or XCCL, although gloo all-reduces bf16 tensors; the netbench
ranks talk over gloo, so this is its 16-bit bf16 baseline. 2 bytes per element on the wire, as torch's.

Example::

    DDPStrategy(process_group_backend="gloo", ddp_comm_hook=bf16_hook)
"""

# no ``from __future__ import annotations``: DDP checks the hook's annotations as objects
import torch
import torch.distributed as dist


def bf16_hook(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The averaged bucket through a bf16 all-reduce (module docstring)."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return fut.then(decompress)
