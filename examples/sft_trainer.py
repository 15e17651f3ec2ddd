"""Supervised fine-tuning with TRL's SFTTrainer at long context, each sequence split over
GPUs by easy_context. The two lines marked ``# easy_context`` are all that a plain SFTTrainer
script gains; launch it as before:

    accelerate launch --config_file examples/accelerate/fsdp2.yaml --num_processes 8 \\
        examples/sft_trainer.py --model meta-llama/Llama-3.1-8B --dataset my/dataset \\
        --seq-length 131072 --sp-size 8

Without --model and --dataset it builds a tiny Llama and generated text, so it runs anywhere
(a CPU included) without downloading anything.
"""

import argparse

import torch
from accelerate import PartialState
from datasets import Dataset, load_dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

from easy_context import enable_sequence_parallel  # easy_context

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="a model folder or Hub name (default: a tiny Llama)")
parser.add_argument("--dataset", help="a dataset with a 'text' (or 'messages') column")
parser.add_argument("--seq-length", type=int, default=1024)
parser.add_argument("--method", default="zigzag_ring_attn")
parser.add_argument("--sp-size", type=int, help="ranks per sequence (default: all)")
parser.add_argument("--lora", action="store_true")
parser.add_argument("--max-steps", type=int, default=4)
parser.add_argument("--output-dir", default="sft-output")
args = parser.parse_args()
# the launcher's processes, as the Trainer will see them (gloo ranks on a machine without GPUs)
state = PartialState(cpu=not torch.cuda.is_available())

if args.model is None:  # offline: the demo's tiny Llama and tokenizer, built once
    from pathlib import Path

    from easy_context.demo.build import ModelShape, build_model, build_tokenizer

    args.model = "tiny-llama"
    with state.main_process_first():
        if not Path(args.model, "config.json").exists():
            build_model(Path(args.model), build_tokenizer(Path(args.model), 512, seed=0),
                        ModelShape(max_position_embeddings=8192), seed=0)
if args.dataset is None:
    from easy_context.data.synthetic import generate_texts

    dataset = Dataset.from_dict({"text": generate_texts(64, 6000, seed=0)})
else:
    dataset = load_dataset(args.dataset, split="train")

tokenizer = AutoTokenizer.from_pretrained(args.model)
model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto")
config = SFTConfig(
    output_dir=args.output_dir, max_length=args.seq_length, packing=True,
    per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=args.max_steps,
    learning_rate=1e-4 if args.lora else 2e-5, gradient_checkpointing=True, bf16=True,
    logging_steps=1, save_strategy="no", report_to=[],
    use_cpu=not torch.cuda.is_available())  # a machine without GPUs: gloo ranks on the CPU
peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear") if args.lora else None
trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                     peft_config=peft_config)
enable_sequence_parallel(trainer, method=args.method, sp_size=args.sp_size)  # easy_context
trainer.train()
trainer.save_model()
