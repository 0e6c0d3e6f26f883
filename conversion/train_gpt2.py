"""Train a small GPT-2 briefly on Wikipedia (no pretrained GPT-2 ships offline) to have a GPT-2
checkpoint with real attention patterns to convert.

    python conversion/train_gpt2.py --output out/gpt2-small-wiki --minutes 5

Uses the exact GPT-2 tokenizer (``hf_rfa.assets.gpt2_tokenizer_path()``), the Wikipedia *train*
articles, ``GPT2LMHeadModel`` (Conv1D projections, learned absolute positions). With Hub access,
convert the real one instead: ``python conversion/convert.py --model gpt2 ...``.
"""

from __future__ import annotations

import argparse
import logging
import math
import time



def main(argv: list[str] | None = None) -> None:
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from hf_rfa import assets
    from hf_rfa.recipes import evaluation

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    torch.manual_seed(a.seed)
    tok = AutoTokenizer.from_pretrained(assets.gpt2_tokenizer_path())
    ids = evaluation.tokenize(tok, evaluation.load_text("wikipedia:train"))
    cfg = GPT2Config(vocab_size=len(tok), n_positions=1024, n_embd=a.hidden, n_layer=a.layers, n_head=a.heads,
                     bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    stream = evaluation.shuffled_batches(ids, a.context, a.batch_size, a.seed)
    start, step = time.time(), 0
    bar = tqdm(desc="train gpt2", unit="step")
    model.train()
    while time.time() - start < 60 * a.minutes:
        x, _ = next(stream)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for g in opt.param_groups:
            g["lr"] = a.lr * min(1.0, (step + 1) / 20)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss):.3f}")
    bar.close()
    model.eval()
    model.save_pretrained(a.output)
    tok.save_pretrained(a.output)
    print(f"trained {step} steps ({step * a.batch_size * a.context} tokens, {(time.time() - start) / 60:.1f} min), "
          f"last loss {float(loss):.3f} (ppl {math.exp(float(loss)):.0f}); saved to {a.output}")


if __name__ == "__main__":
    main()
