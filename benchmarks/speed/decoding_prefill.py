"""Prefill of K-hypothesis decoding on LLaVA-NeXT: the frozen vision tower run once for the K copies of a batch
against once per copy (what decoding did before: the raw inputs repeated K times).

A randomly initialised LlavaNextForConditionalGeneration (a CLIP vision tower, a Llama language model) with
adapters on q/k/v/up/down of the language model only (paper App. H.2), anyres images of different sizes, K
hypotheses decoded by ``generate_hypotheses`` with one new token (the prefill and one step). The two settings
(``MCLModel.share_frozen_modules`` True / False) are interleaved repeat by repeat and the median of each is kept;
the headline is their ratio, measured side by side. Before timing, the script checks that both give the same tokens.

    python -m benchmarks.speed.decoding_prefill                  # CPU, a few minutes
    python -m benchmarks.speed.decoding_prefill --threads 1      # when other processes share the CPU
    python -m benchmarks.speed.decoding_prefill --device cuda --vision_hidden 1024 --vision_layers 24 --image 336 \
        --patch 14 --hidden 4096 --layers 32 --dtype bfloat16  # LLaVA-1.6-7B's shapes (random weights)
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.common import perturb_adapters, timed
from loramcl import MCLConfig, get_mcl_model
from loramcl.decoding import generate_hypotheses

IMAGE_TOKEN = 3


def build(args):
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration

    torch.manual_seed(0)
    side = args.image
    config = LlavaNextConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=args.vision_hidden,
                           intermediate_size=args.vision_hidden * 4, num_hidden_layers=args.vision_layers,
                           num_attention_heads=max(args.vision_hidden // 64, 1), image_size=side,
                           patch_size=args.patch, projection_dim=args.vision_hidden),
        text_config=dict(model_type="llama", vocab_size=1000, hidden_size=args.hidden,
                         intermediate_size=args.hidden * 8 // 3, num_hidden_layers=args.layers,
                         num_attention_heads=max(args.hidden // 64, 1), num_key_value_heads=max(args.hidden // 64, 1),
                         max_position_embeddings=8192),
        image_token_index=IMAGE_TOKEN, image_grid_pinpoints=[[side, side], [side, 2 * side], [2 * side, side],
                                                             [2 * side, 2 * side]], vision_feature_layer=-2)
    base = LlavaNextForConditionalGeneration(config).to(args.device, getattr(torch, args.dtype)).eval()
    mcl = get_mcl_model(base, MCLConfig(num_hypotheses=args.k, r=8, alpha=32, target_modules=(
        r".*language_model.*\.(q_proj|k_proj|v_proj|up_proj|down_proj)")))
    perturb_adapters(mcl)
    return mcl.eval()


def batch(mcl, args) -> dict:
    """B images of different sizes (1x1, 1x2, 2x1, 2x2 tiles of the crop size, in turn), each its image tokens then
    10 prompt tokens, left-padded."""
    side, g = args.image, torch.Generator().manual_seed(1)
    shapes = [(side, side), (side, 2 * side), (2 * side, side), (2 * side, 2 * side)]
    sizes = torch.tensor([shapes[i % len(shapes)] for i in range(args.batch)])
    pixel_values = torch.randn(args.batch, 5, 3, side, side, generator=g)  # up to 4 tiles + the whole image
    pixel_values = pixel_values.to(args.device, getattr(torch, args.dtype))
    with torch.no_grad():
        features = mcl.base_model.model.get_image_features(pixel_values=pixel_values, image_sizes=sizes.to(
            args.device)).pooler_output
    counts = [f.shape[0] for f in features]
    width = max(counts) + 10
    input_ids = torch.zeros(args.batch, width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, n in enumerate(counts):
        input_ids[row, width - n - 10:width - 10] = IMAGE_TOKEN
        input_ids[row, width - 10:] = torch.randint(10, 1000, (10,), generator=g)
        attention_mask[row, width - n - 10:] = 1
    return {"input_ids": input_ids.to(args.device), "attention_mask": attention_mask.to(args.device),
            "pixel_values": pixel_values, "image_sizes": sizes.to(args.device)}, counts


def prefill(mcl, inputs, shared: bool):
    mcl.share_frozen_modules = shared
    try:
        return generate_hypotheses(mcl, None, inputs, max_new_tokens=1, min_new_tokens=1, log_probs=False)
    finally:
        mcl.share_frozen_modules = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--image", type=int, default=112, help="crop side in pixels")
    parser.add_argument("--patch", type=int, default=14)
    parser.add_argument("--vision_hidden", type=int, default=256)
    parser.add_argument("--vision_layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    mcl = build(args)
    inputs, counts = batch(mcl, args)
    once = prefill(mcl, inputs, shared=True)
    repeated = prefill(mcl, inputs, shared=False)
    assert [[c.token_ids for c in row] for row in once] == [[c.token_ids for c in row] for row in repeated]
    times = {True: [], False: []}
    for _ in range(args.repeats):
        for shared in (True, False):
            times[shared].append(timed(lambda shared=shared: prefill(mcl, inputs, shared), args.device))
    tower_once, tower_k = statistics.median(times[True]), statistics.median(times[False])
    vision = sum(p.numel() for n, p in mcl.base_model.named_parameters() if "vision_tower" in n)
    language = sum(p.numel() for n, p in mcl.base_model.named_parameters() if "language_model" in n)
    print(f"LLaVA-NeXT (random): vision tower {vision / 1e6:.1f}M, language model {language / 1e6:.1f}M parameters; "
          f"K={args.k}, {args.batch} images of {counts} image tokens, {args.device} {args.dtype}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"prefill (+1 token), tower once: {tower_once:.3f} s; tower on each of the K copies: {tower_k:.3f} s; "
          f"ratio K-times / once: {tower_k / tower_once:.2f}x")


if __name__ == "__main__":
    main()
