"""What the bench measures: the workload texts, the warm-up and its length.

Fixed texts, so that runs on different days and machines compare; the MLX bench and the served
bench ask the same ones.
"""

from __future__ import annotations

WARMUP_TOKENS = 8  # generated tokens of each arm's warm-up run

ECHO_CODE = '''\
import csv
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Order:
    order_id: str
    customer: str
    amount: float
    paid: bool


def load_orders(path: Path) -> list[Order]:
    orders = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            orders.append(Order(row["id"], row["customer"],
                                float(row["amount"]), row["paid"] == "yes"))
    return orders


def summarize(orders: list[Order]) -> dict[str, float]:
    total = 0.0
    unpaid = 0.0
    for order in orders:
        total += order.amount
        if not order.paid:
            unpaid += order.amount
    share = unpaid / total if total else 0.0
    return {"total": total, "unpaid": unpaid, "share": share}


def top_customers(orders: list[Order], n: int = 3) -> list[str]:
    by_customer: dict[str, float] = {}
    for order in orders:
        by_customer[order.customer] = by_customer.get(order.customer, 0.0) + order.amount
    ranked = sorted(by_customer, key=by_customer.get, reverse=True)
    return ranked[:n]
'''

EDIT_CODE = '''\
def fetch_json(url, retries=3):
    last_error = None
    for attempt in range(retries):
        try:
            with urlopen(url) as response:
                return json.loads(response.read())
        except URLError as e:
            last_error = e
            time.sleep(2 ** attempt)
    raise last_error
'''

WORKLOADS: dict[str, list[dict[str, str]]] = {
    # Output echoes the prompt almost verbatim: where prompt lookup should shine.
    "echo": [{"role": "user", "content": (
        "Rename the variable `total` to `grand_total` everywhere in this Python module. "
        "Reply with the complete updated module in one code block and nothing else.\n\n"
        f"```python\n{ECHO_CODE}```")}],
    # Agentic-style edit: a small function, instructions, part echo and part new code.
    "code-edit": [
        {"role": "system", "content": "You are a coding agent. Apply the requested change and "
                                      "reply with the full updated function only."},
        {"role": "user", "content": (
            "Task: add a `timeout` parameter (default 10.0 seconds) to `fetch_json` and pass it "
            "to `urlopen`; also add a docstring. Keep everything else unchanged.\n\n"
            f"File `net.py`:\n```python\n{EDIT_CODE}```")}],
    # Novel answers: little to look up, so drafters should at least not lose.
    "qa": [{"role": "user", "content": (
        "Answer each question in two or three sentences.\n"
        "1. Why is the sky blue?\n"
        "2. What does a CPU cache do?\n"
        "3. Who wrote Pride and Prejudice, and when was it published?\n"
        "4. How do vaccines train the immune system?")}],
    "creative": [{"role": "user", "content": (
        "Write a short story of about 200 words about a lighthouse keeper who finds a message "
        "in a bottle written in her own handwriting.")}],
}

# A coding agent's session, second turn measured: the first turn (the file, a change asked for,
# the agent's answer) is in the conversation, and was an earlier request on this node.
AGENT_SYSTEM = ("You are a coding agent. You edit files in the user's repository. Reply with the "
                "complete updated file in one code block and nothing else.")
AGENT_TURN1 = ("Add a function `average_order(orders)` to `orders.py` that returns the mean "
               "order amount (0.0 for no orders).\n\n"
               f"`orders.py`:\n```python\n{ECHO_CODE}```")
AGENT_REPLY1 = f'''```python
{ECHO_CODE}

def average_order(orders: list[Order]) -> float:
    if not orders:
        return 0.0
    return sum(order.amount for order in orders) / len(orders)
```'''
AGENT_TURN2 = ("Good. Now make `top_customers` count only paid orders. Reply with the complete "
               "updated `orders.py`.")
AGENT_FIRST = [{"role": "system", "content": AGENT_SYSTEM},
               {"role": "user", "content": AGENT_TURN1}]

# A novel request sent twice (a client retrying after a timeout, or a templated job): the
# second, measured, can draft from the first's output in the engine's memory.
RETRY = [{"role": "user", "content": (
    "Write a short poem of about 120 words about a fox who learns to read the stars, then "
    "explain in two sentences what the poem is about.")}]

WORKLOADS["agent"] = [*AGENT_FIRST, {"role": "assistant", "content": AGENT_REPLY1},
                      {"role": "user", "content": AGENT_TURN2}]
WORKLOADS["retry"] = RETRY

# Earlier requests of a workload's session, sent to the same engine (or server) before the
# measured one, unmeasured: every arm starts from a fresh engine or server per measured
# request, so this is all it can remember.
SESSIONS: dict[str, list[list[dict[str, str]]]] = {
    "agent": [AGENT_FIRST],
    "retry": [RETRY],
}

# Each arm's warm-up (kernels, allocator), short and unlike any workload.
WARMUP_MESSAGES = [{"role": "user", "content": "Repeat exactly: red green blue red green blue"}]
