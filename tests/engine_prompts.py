"""Sixteen varied prompts for the engine tests: chat turns, code, numbers, names, several
languages and scripts, a one-token prompt and two of about 200 tokens."""
from __future__ import annotations

_LONG_STORY = (
    "The harbour town of Kestrel Bay had been quiet for most of the winter. Fishing boats stayed "
    "tied to the pier, the bakery opened only on weekends, and the lighthouse keeper, an old man "
    "named Tobias Wren, spent his evenings writing letters to a daughter who lived across the sea. "
    "In March a stranger arrived on the last ferry of the day. She carried a single leather case "
    "and asked at the inn for a room facing the water. Nobody knew her name, and she did not offer "
    "it. Each morning she walked to the end of the breakwater, sat on the cold stones, and watched "
    "the horizon for hours, as if she expected a ship that the timetable did not list. By the "
    "third week the whole town was talking about her. One evening Tobias finally climbed down "
    "from the lighthouse, walked out along the breakwater, and sat beside her. For a long time "
    "neither of them spoke. Then she turned to him and said"
)

_LONG_CODE = '''import json
from dataclasses import dataclass, field


@dataclass
class Invoice:
    number: str
    customer: str
    amount_cents: int
    paid: bool = False
    lines: list[str] = field(default_factory=list)


def load_invoices(path):
    """Read invoices from a JSON file, skipping malformed records."""
    invoices = []
    with open(path) as f:
        for record in json.load(f):
            try:
                invoices.append(Invoice(record["number"], record["customer"],
                                        int(record["amount_cents"])))
            except (KeyError, ValueError):
                continue
    return invoices


def total_outstanding(invoices):
    """Sum of the amounts of all unpaid invoices, in cents."""
'''

PROMPTS = [
    "Hi",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are a concise assistant.<|im_end|>\n<|im_start|>user\n"
    "Give me three tips for sleeping better.<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "SELECT customer_id, SUM(amount) FROM orders WHERE",
    "1, 1, 2, 3, 5, 8, 13, 21,",
    "The invoice INV-2026-0915 for $4,312.50 is due on",
    "Yusuf Okonkwo-Reyes and Mei-Ling Zhang met in Lagos in 1998. Their first project was",
    "La vie est belle, mais",
    "Der schnellste Weg von Berlin nach München ist",
    "東京の天気は今日",
    "Привет! Как дела? Сегодня мы поговорим о",
    "Once upon a time",
    "Q: What is 17 times 23?\nA:",
    _LONG_STORY,
    _LONG_CODE,
]
