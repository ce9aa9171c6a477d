"""`llm-rlhf ARGS...` under `accelerate launch --config_file accelerate_configs/fsdp.yaml` on a machine
without GPUs, with ONE patch (test only): accelerate 1.15 turns FSDP on only when it sees an accelerator
device (`AcceleratorState.__init__` sets `DistributedType.FSDP` only on MULTI_GPU/NPU/XPU/...); on CPU it
leaves MULTI_CPU (DDP over gloo). The patch does, after that `__init__`, what its FSDP branch does:
`distributed_type = FSDP` (in the accelerator's and the process's shared state), the plugin's mixed
precision from `mixed_precision` (bf16: FSDP2's `MixedPrecisionPolicy`) and the `fsdp_plugin` that
accelerate built from the config file; everything else — the plugin, `prepare`
(`fsdp2_prepare_model`: torch's `fully_shard` at each transformer block, the root), no_sync, gradient
clipping, and our code — runs unpatched, over gloo on CPU.

    python fsdp2_on_cpu.py ARGS...              (ARGS: what follows `-m llm_rlhf`)
    python fsdp2_on_cpu.py SCRIPT.py ARGS...    (a test script, e.g. ppo_ranks.py, run as __main__)
"""

from __future__ import annotations

import runpy
import sys

import accelerate.state
from accelerate.utils import DistributedType

from llm_rlhf.interfaces import cli

original_init = accelerate.state.AcceleratorState.__init__


def init_with_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    original_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = fsdp_plugin
        accelerate.state.PartialState._shared_state["distributed_type"] = (
            DistributedType.FSDP
        )  # as accelerate does


accelerate.state.AcceleratorState.__init__ = init_with_fsdp_on_cpu

if __name__ == "__main__":
    if sys.argv[1].endswith(".py"):  # the script sees its own argv, as if launched itself
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")
    else:
        cli.exit_process(cli.main(sys.argv[1:]))
