"""Causal-LM training with transformers' Trainer on long sequences (text cut into blocks of
--seq-length tokens, as run_clm.py does), each sequence split over GPUs by easy_context. The
two lines marked ``# easy_context`` are all that a plain Trainer script gains:

    accelerate launch --config_file examples/accelerate/deepspeed_zero3.yaml \\
        --num_processes 8 examples/hf_trainer.py --model Qwen/Qwen3-8B --seq-length 65536

Without --model and --dataset it builds a tiny Llama and generated text, so it runs anywhere
(a CPU included) without downloading anything.
"""

import argparse
from itertools import chain

import torch
from accelerate import PartialState
from datasets import Dataset, load_dataset
from transformers import (AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments,
                          default_data_collator)

from easy_context import enable_sequence_parallel  # easy_context

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="a model folder or Hub name (default: a tiny Llama)")
parser.add_argument("--dataset", help="a dataset with a 'text' column")
parser.add_argument("--seq-length", type=int, default=1024)
parser.add_argument("--method", default="zigzag_ring_attn")
parser.add_argument("--sp-size", type=int, help="ranks per sequence (default: all)")
parser.add_argument("--max-steps", type=int, default=4)
parser.add_argument("--output-dir", default="trainer-output")
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

    texts = Dataset.from_dict({"text": generate_texts(64, 6000, seed=0)})
else:
    texts = load_dataset(args.dataset, split="train")

tokenizer = AutoTokenizer.from_pretrained(args.model)


def blocks(batch):
    """Concatenate the documents and cut them into --seq-length token blocks."""
    ids = list(chain.from_iterable(tokenizer(batch["text"])["input_ids"]))
    n = len(ids) // args.seq_length * args.seq_length
    rows = [ids[i:i + args.seq_length] for i in range(0, n, args.seq_length)]
    return {"input_ids": rows, "labels": [list(r) for r in rows]}


with state.main_process_first():
    dataset = texts.map(blocks, batched=True, remove_columns=texts.column_names)
model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto")
training_args = TrainingArguments(
    output_dir=args.output_dir, per_device_train_batch_size=1, gradient_accumulation_steps=2,
    max_steps=args.max_steps, learning_rate=2e-5, gradient_checkpointing=True, bf16=True,
    logging_steps=1, save_strategy="no", report_to=[],
    use_cpu=not torch.cuda.is_available())  # a machine without GPUs: gloo ranks on the CPU
trainer = Trainer(model=model, args=training_args, train_dataset=dataset,
                  data_collator=default_data_collator)
enable_sequence_parallel(trainer, method=args.method, sp_size=args.sp_size)  # easy_context
trainer.train()
trainer.save_model()
