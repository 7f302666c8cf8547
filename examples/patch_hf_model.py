#!/usr/bin/env python
"""Patch a HuggingFace model with gradops in one line, then train it.

Builds a tiny Llama from a config written here (random weights, no download), replaces its
RMSNorms with gradops' (``gradops.patch``), prints the report, and trains a few AdamW steps
on a fixed batch, printing the loss. Runs on a CPU in a few seconds; on a GPU the norms run
gradops' Triton kernels.

    pip install -e '.[test]'          # gradops with transformers
    python examples/patch_hf_model.py
"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import gradops


def main(steps: int = 5) -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # built before patching: still valid after

    report = gradops.patch(model)  # the one line
    print(report)

    ids = torch.randint(0, config.vocab_size, (4, 32), device=device)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.4f}")

    restored = gradops.unpatch(model)  # transformers' own modules back, holding the trained weights
    print(restored)


if __name__ == "__main__":
    main()
