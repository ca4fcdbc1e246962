"""Writes a tiny random Llama-style model to the directory given (the hub
is not reachable here; the check needs a model's shapes, not its weights):
2 layers, 4 KV heads of 64, bf16."""
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
out = sys.argv[1]
cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  head_dim=64, max_position_embeddings=1024, torch_dtype="bfloat16",
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
torch.manual_seed(0)
m = LlamaForCausalLM(cfg).to(torch.bfloat16)
m.save_pretrained(out)
print("saved", out)
