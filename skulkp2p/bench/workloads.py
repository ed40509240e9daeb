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

# A question over a given context: a passage written for the bench (a village that is not in
# any corpus, so the model cannot answer from memory), questions whose answers draw on it, some
# in its own words. What the drafters can copy is in the request itself.
CONTEXT_PASSAGE = """\
In the spring of 1987 the village of Kessow, on the northern shore of Lake Tarrin, lost its \
only bridge to a flood. For eleven years the 640 people of Kessow reached the market town of \
Brevik by a ferry that a retired fisherman, Aldo Fenn, ran twice a day in a converted herring \
boat called the Marit. The crossing took forty minutes in calm weather and up to two hours in \
the autumn storms, and on nine days each winter the lake froze too hard for the boat and too \
thinly for anyone to walk across.

The village council asked the regional government for a new bridge four times, and was \
refused each time because the road on the far side carried too little traffic. In 1994 a \
schoolteacher, Ines Varga, proposed that the village build a footbridge itself. She argued \
that a narrow bridge for walkers, bicycles and handcarts would cost a tenth of a road bridge \
and that the villagers could do most of the labour. The council agreed, on the condition that \
the bridge be paid for without raising local taxes.

The money came from three sources: a lottery run by the school, which raised 41,000 crowns \
over two years; the sale of a disused grain store to a boat builder for 65,000 crowns; and a \
grant of 120,000 crowns from a foundation in the capital, which Varga won after writing, by \
her own count, thirty-one letters. Construction began in May 1996. An engineer from Brevik, \
Tomas Ruud, gave his time for free and insisted on steel cables instead of the timber trusses \
of the first design, because ice pushed against the piers every winter.

The Kessow footbridge opened on 14 September 1998. It is 212 metres long and 2.4 metres wide, \
and it has been closed only twice since, both times for repainting. Aldo Fenn steered the \
Marit under the bridge on the opening day and then sold her to a museum in Brevik, where she \
is still on display. A survey in 2010 found that the number of children from Kessow attending \
the secondary school in Brevik had doubled since the bridge opened.
"""

WORKLOADS["ctxqa"] = [
    {"role": "system", "content": "Answer from the passage the user gives. Where the passage "
                                  "answers a question in its own words, quote them."},
    {"role": "user", "content": (
        f"Passage:\n\n{CONTEXT_PASSAGE}\n"
        "Questions:\n"
        "1. Why did the regional government refuse to build a new bridge?\n"
        "2. Where did the money for the footbridge come from, and how much did each source "
        "give?\n"
        "3. What did Tomas Ruud change in the design, and why?\n"
        "4. What happened to the Marit after the bridge opened?\n"
        "5. In three sentences, what did the bridge change for the village?")}]

# Long on its own: a guide in ten named sections, so that `--max-tokens 200,1000` compares the
# lengths on text the model chose to write, not on what it writes past EOS (`--ignore-eos`).
# SmolLM2-135M loops greedy and stops near 500 tokens sampled (docs/bench.md).
WORKLOADS["guide"] = [{"role": "user", "content": (
    "Write a complete guide to setting up a freshwater aquarium, in ten numbered sections, each "
    "with a heading and at least two paragraphs: 1. Choosing a tank, 2. Filters, 3. Heaters and "
    "lights, 4. Gravel and plants, 5. Cycling the water, 6. Choosing fish, 7. Feeding, "
    "8. Cleaning, 9. Common diseases, 10. A weekly care checklist.")}]

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

# --------------------------------------------------------------------------------------------
# The multi-turn agent workload (`bench --agent`): one conversation that grows turn by turn, as
# a coding agent's does: read a file (about 1,000 tokens), edit it, a tool's result, edit again.
# The model's own answer of each turn goes into the next turn's messages.

AGENT_FILE = '''\
"""Inventory of a small shop: items, stock movements, reorder suggestions and a CSV report."""

from __future__ import annotations

import csv
import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Item:
    sku: str
    name: str
    unit_price: float
    stock: int = 0
    reorder_level: int = 5
    supplier: str = "unknown"
    history: list[tuple[dt.date, int]] = field(default_factory=list)

    def value(self) -> float:
        return self.unit_price * self.stock

    def needs_reorder(self) -> bool:
        return self.stock <= self.reorder_level


class Inventory:
    def __init__(self) -> None:
        self.items: dict[str, Item] = {}

    def add(self, item: Item) -> None:
        if item.sku in self.items:
            raise ValueError(f"duplicate sku {item.sku}")
        self.items[item.sku] = item

    def receive(self, sku: str, quantity: int, day: dt.date) -> None:
        item = self.items[sku]
        item.stock += quantity
        item.history.append((day, quantity))

    def sell(self, sku: str, quantity: int, day: dt.date) -> float:
        item = self.items[sku]
        if quantity > item.stock:
            raise ValueError(f"only {item.stock} of {sku} left")
        item.stock -= quantity
        item.history.append((day, -quantity))
        return quantity * item.unit_price

    def total_value(self) -> float:
        total = 0.0
        for item in self.items.values():
            total += item.value()
        return total

    def reorder_list(self) -> list[Item]:
        return sorted((i for i in self.items.values() if i.needs_reorder()),
                      key=lambda i: (i.supplier, i.sku))

    def sales_between(self, start: dt.date, end: dt.date) -> dict[str, int]:
        sold: dict[str, int] = {}
        for item in self.items.values():
            for day, change in item.history:
                if start <= day <= end and change < 0:
                    sold[item.sku] = sold.get(item.sku, 0) - change
        return sold

    def best_sellers(self, start: dt.date, end: dt.date, n: int = 3) -> list[str]:
        sold = self.sales_between(start, end)
        ranked = sorted(sold, key=sold.get, reverse=True)
        return ranked[:n]


def load_inventory(path: Path) -> Inventory:
    inventory = Inventory()
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            inventory.add(Item(sku=row["sku"], name=row["name"],
                               unit_price=float(row["unit_price"]),
                               stock=int(row["stock"]),
                               reorder_level=int(row.get("reorder_level") or 5),
                               supplier=row.get("supplier") or "unknown"))
    return inventory


def write_report(inventory: Inventory, path: Path) -> int:
    rows = 0
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["sku", "name", "stock", "value", "reorder"])
        for item in sorted(inventory.items.values(), key=lambda i: i.sku):
            writer.writerow([item.sku, item.name, item.stock, f"{item.value():.2f}",
                             "yes" if item.needs_reorder() else "no"])
            rows += 1
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: inventory.py STOCK.csv REPORT.csv")
        return 2
    inventory = load_inventory(Path(argv[1]))
    rows = write_report(inventory, Path(argv[2]))
    print(f"{rows} items, total value {inventory.total_value():.2f}")
    for item in inventory.reorder_list():
        print(f"reorder {item.sku} ({item.name}) from {item.supplier}")
    return 0
'''

AGENT_SYSTEM = (
    "You are a coding agent working in a Python repository. You can call tools by writing one "
    "line: read_file(path), write_file(path), run_tests(). When you edit code, show the "
    "complete changed function in a python code block.")

# The user's (or the tools') side of each turn; the assistant's side is the model's own answer.
AGENT_TURNS: list[tuple[str, str]] = [
    ("ask", "The report from inventory.py lists items that are out of stock as 'no' in the "
            "reorder column when their reorder level is 0. Find out why. Start by reading the "
            "file."),
    ("read_file", f"Tool result of read_file('inventory.py'):\n```python\n{AGENT_FILE}```"),
    ("edit", "Fix it: an item whose stock is 0 always needs a reorder. Show the changed method "
             "only."),
    ("tool_result", "Tool result of run_tests():\n"
                    "FAILED tests/test_inventory.py::test_sell_more_than_stock - ValueError: "
                    "only 2 of A-17 left\n"
                    "    inventory.sell('A-17', 3, day)\n"
                    "  inventory.py:51: in sell\n"
                    "1 failed, 14 passed in 0.21s\n"
                    "The test expects sell() to sell what is left and return its price instead "
                    "of raising."),
    ("edit_again", "Change sell() so that it sells at most the stock left and returns the price "
                   "of what it sold. Show the complete updated function."),
    ("summary", "Tool result of run_tests(): 15 passed in 0.19s. Summarise your two changes in "
                "two short sentences."),
]

# The shared-prefix pair: the same ~1,000-token prefix (system prompt and file), two questions.
SHARED_PREFIX_QUESTIONS = (
    "Which method of Inventory would you change to support returns of sold items? Answer in one "
    "sentence.",
    "List the functions of this module that read or write files.",
)


def agent_messages(answers: list[str]) -> list[dict[str, str]]:
    """The conversation before turn len(answers) + 1, with the model's earlier answers."""
    messages = [{"role": "system", "content": AGENT_SYSTEM}]
    for (_, user), answer in zip(AGENT_TURNS, answers, strict=False):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": AGENT_TURNS[len(answers)][1]})
    return messages


def shared_prefix_messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": AGENT_SYSTEM},
            {"role": "user", "content": f"File inventory.py:\n```python\n{AGENT_FILE}```\n\n"
                                        f"{question}"}]

# --------------------------------------------------------------------------------------------
# The structured set (`bench --structured`): each workload's messages and the JSON Schema every
# engine arm but `free_plain` (and llama-server, as its `json_schema`) is constrained to. Strings
# and arrays are bounded, so a valid output ends well inside the bench's 200 tokens.

EXTRACT_TEXT = (
    "Harbor Bikes was founded in 2011 in Rotterdam by Mila Jansen, who is still its CEO. The "
    "company employs 240 people and sells three products: the City Cruiser, the Cargo Hauler "
    "and the Folding Commuter. Its revenue in 2023 was 38.5 million euros, and it ships to 14 "
    "countries. Harbor Bikes is privately held.")

EXTRACT_SCHEMA = {
    "type": "object",
    "properties": {
        "company": {"type": "string", "maxLength": 40},
        "founded": {"type": "integer", "minimum": 1800, "maximum": 2030},
        "city": {"type": "string", "maxLength": 40},
        "ceo": {"type": "string", "maxLength": 40},
        "employees": {"type": "integer", "minimum": 0},
        "products": {"type": "array", "items": {"type": "string", "maxLength": 40},
                     "maxItems": 5},
        "revenue_million_eur": {"type": "number"},
        "countries": {"type": "integer", "minimum": 0},
        "public": {"type": "boolean"},
    },
    "required": ["company", "founded", "city", "ceo", "employees", "products",
                 "revenue_million_eur", "countries", "public"],
    "additionalProperties": False,
}

TOOL_SCHEMA = {  # the arguments of a function `book_flight`, as a tool call carries them
    "type": "object",
    "properties": {
        "origin": {"type": "string", "maxLength": 30},
        "destination": {"type": "string", "maxLength": 30},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
        "cabin": {"enum": ["economy", "premium_economy", "business", "first"]},
        "return_date": {"type": ["string", "null"], "maxLength": 10},
        "flexible": {"type": "boolean"},
    },
    "required": ["origin", "destination", "date", "passengers", "cabin", "return_date",
                 "flexible"],
    "additionalProperties": False,
}

ORDERS_CSV = """\
id,customer,item,quantity,paid
A-101,Ada Park,desk lamp,2,yes
A-102,Ben Ortiz,office chair,1,no
A-103,Chen Wu,monitor stand,3,yes
A-104,Dina Roy,desk lamp,1,yes
"""

LIST_SCHEMA = {
    "type": "object",
    "properties": {"orders": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
        "type": "object",
        "properties": {"id": {"type": "string", "maxLength": 8},
                       "customer": {"type": "string", "maxLength": 20},
                       "item": {"type": "string", "maxLength": 20},
                       "quantity": {"type": "integer", "minimum": 0, "maximum": 99},
                       "paid": {"type": "boolean"}},
        "required": ["id", "customer", "item", "quantity", "paid"],
        "additionalProperties": False}}},
    "required": ["orders"],
    "additionalProperties": False,
}

FORM_SCHEMA = {  # a support ticket's triage form: nearly every field an enum
    "type": "object",
    "properties": {
        "category": {"enum": ["billing", "shipping", "returns", "technical", "account", "other"]},
        "priority": {"enum": ["low", "normal", "high", "urgent"]},
        "sentiment": {"enum": ["angry", "unhappy", "neutral", "happy"]},
        "product": {"enum": ["city_cruiser", "cargo_hauler", "folding_commuter", "accessory"]},
        "channel": {"enum": ["email", "phone", "chat", "social"]},
        "language": {"enum": ["en", "nl", "de", "fr"]},
        "needs_human": {"type": "boolean"},
        "refund_requested": {"type": "boolean"},
        "tags": {"type": "array", "maxItems": 3, "items": {
            "enum": ["late_delivery", "damaged", "wrong_item", "payment", "warranty"]}},
    },
    "required": ["category", "priority", "sentiment", "product", "channel", "language",
                 "needs_human", "refund_requested", "tags"],
    "additionalProperties": False,
}

STRUCTURED: dict[str, tuple[list[dict[str, str]], dict]] = {
    # Facts from a given text into an object: most values are copied from the prompt.
    "extract": ([{"role": "user", "content": (
        "Extract the facts about the company in this text as a JSON object with the fields "
        "company, founded, city, ceo, employees, products, revenue_million_eur, countries and "
        f"public.\n\nText: {EXTRACT_TEXT}")}], EXTRACT_SCHEMA),
    # A JSON tool call: the arguments of a function, from a user's request.
    "tool-call": ([
        {"role": "system", "content": (
            "You call the function book_flight(origin, destination, date, passengers, cabin, "
            "return_date, flexible) by replying with its arguments as one JSON object. Dates "
            "are YYYY-MM-DD; return_date is null for a one-way trip.")},
        {"role": "user", "content": (
            "Book a one-way business class flight from Amsterdam to Lisbon on 2025-03-14 for "
            "two passengers. The date is not flexible.")}], TOOL_SCHEMA),
    # A list of objects: every row of a small table (four rows: about 150 tokens of JSON).
    "list": ([{"role": "user", "content": (
        "Convert every row of this CSV table into a JSON object with a list `orders` "
        "(paid is a boolean).\n\n" + ORDERS_CSV)}], LIST_SCHEMA),
    # An enum-heavy form: a support ticket's triage.
    "form": ([{"role": "user", "content": (
        "Triage this support email into the JSON form (category, priority, sentiment, product, "
        "channel, language, needs_human, refund_requested, tags).\n\nEmail: My Cargo Hauler "
        "arrived two weeks late and the rear rack is bent. This is the second time! I want my "
        "money back or a new rack sent today. - Sent from my phone")}], FORM_SCHEMA),
}
