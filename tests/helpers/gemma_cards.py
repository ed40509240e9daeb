"""A card pairing the tiny Gemma 4 target with a tiny assistant (tests/helpers/tiny_gemma4.py), written
into a cards folder that a test points SKULKP2P_CARDS_DIR at."""

from __future__ import annotations

from pathlib import Path


def write_gemma_card(cards: Path, card_id: str, target: Path, assistant: Path,
                     block_size: int | None = None, last_stage_from: int | None = None) -> Path:
    cards.mkdir(parents=True, exist_ok=True)
    text = f'''id = "{card_id}"
family = "gemma4"
format = "mlx"
layers = 6
hidden_size = 64
kv_heads = 2
context_length = 4096
size_bytes = 1_000_000

[source]
kind = "local"
path = "{target}"

[speculation]
drafter = "assistant"
assistant_model = "{assistant}"
'''
    if block_size is not None:
        text += f"assistant_block_size = {block_size}\n"
    if last_stage_from is not None:
        text += f"\n[placement]\nlast_stage_from = {last_stage_from}\n"
    path = cards / f"{card_id}.toml"
    path.write_text(text)
    return path
