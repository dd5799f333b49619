"""The same LoRA DPO run as llm_ddp_parallel_training.py --objective dpo, through TRL's DPOTrainer.

What a practitioner would otherwise pick: DPOTrainer with a peft_config (the reference is the same
model with the adapter disabled, computed each step: precompute_ref_log_probs=False, TRL's default; with
--precompute, once before training, as the script does), sigmoid loss,
beta as given, under torchrun's DDP on CPU with Gloo (use_cpu, ddp_backend="gloo", as trl_baseline.py).
Launched by trl_comparison.py --only dpo with the same model folder, the same conversational
preference JSONL ({"prompt": [user turn], "chosen": [assistant turn], "rejected": [assistant turn]}),
LoRA r 8 / alpha 16 on q_proj,v_proj, the same pairs per rank per optimizer step, lr,
warmup, cosine decay to lr/10, weight decay and clipping, one epoch.

Settings that differ from DPOConfig's defaults, set to match the script's CPU run: fp32 (DPOConfig
defaults to bf16 autocast, on CPU too) and no gradient checkpointing (DPOConfig defaults to it on).
Dropout is DPOConfig's default, off (disable_dropout, as the script under --objective dpo). max_length is
--seq-len per sequence (prompt + completion). Prints one line on rank 0, "result: {json}": the train
loop's seconds, the pairs it trained on, the optimizer steps, peak memory and the adapter's folder.

    PYTHONPATH=$TRL_SITE:. torchrun --standalone --nproc_per_node=2 benchmarks/trl_dpo_baseline.py \\
        --model DIR --data FILE --out DIR --batch-size 4 --seq-len 128 --lr 1e-3 --warmup-steps 10 --beta 0.1
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist
from trl import DPOConfig, DPOTrainer
from trl_baseline import report, shared_config, shared_flags, trained

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import llm_ddp_parallel_training as script


def main() -> None:
    p = shared_flags()
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--precompute", action="store_true", help="precompute_ref_log_probs=True")
    a = p.parse_args()
    config = DPOConfig(beta=a.beta, loss_type=["sigmoid"], precompute_ref_log_probs=a.precompute, bf16=False,
                       gradient_checkpointing=False, **shared_config(a))  # fmt: skip
    trainer, result = trained(DPOTrainer, config, a)
    pairs = result.global_step * a.batch_size * dist.get_world_size()
    report(trainer, result, a, pairs=pairs, train_loss=result.training_loss)


if __name__ == "__main__":
    main()
    script.leave_finished()  # as the script does: Gloo's threads can abort the interpreter's shutdown
