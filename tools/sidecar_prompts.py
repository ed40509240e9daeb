"""Prompt sets for training a drafting head on the model's own answers (tools/train_sidecar.py).

`train_prompts()` is a broad, deterministic list: task templates (questions, explanations,
instructions, lists, stories, poems, letters, dialogues, code, comparisons, advice) crossed with
topics from many fields, so the head sees the kinds of text a chat model writes.

`HELDOUT_PROMPTS` is a separate, hand-written set used only to measure acceptance: a different
style (several numbered questions in one message, first-person requests with a situation,
role-play, riddles), mostly on subjects outside the training topics; none of its prompts is in
the training list (train_sidecar checks), and none is one of the bench's workload texts
(skulkp2p/bench/workloads.py).
"""

from __future__ import annotations

import random

TOPICS = (
    # science and nature
    "photosynthesis", "black holes", "plate tectonics", "the water cycle", "DNA replication",
    "the immune system", "climate change", "volcanoes", "magnetism", "the periodic table",
    "evolution by natural selection", "the solar system", "earthquakes", "ocean tides",
    "rainbows", "bacteria and viruses", "the human heart", "sleep", "honeybees", "coral reefs",
    "rainforests", "deserts", "glaciers", "electricity", "gravity", "sound waves", "nuclear energy",
    "the moon", "dinosaurs", "the brain", "vitamins", "antibiotics", "tornadoes", "fungi",
    # technology and computing
    "the internet", "databases", "machine learning", "encryption", "operating systems",
    "smartphones", "solar panels", "electric cars", "3D printing", "cloud computing",
    "version control with git", "recursion", "sorting algorithms", "hash tables", "compilers",
    "web browsers", "password security", "robots", "GPS", "batteries", "spreadsheets",
    # history and society
    "the Roman Empire", "the printing press", "the Industrial Revolution", "ancient Egypt",
    "the French Revolution", "the Silk Road", "the Renaissance", "the Cold War", "democracy",
    "the invention of the telephone", "the history of money", "the Olympic Games",
    "medieval castles", "the Vikings", "the Great Wall of China", "the United Nations",
    # everyday life
    "cooking pasta", "baking bread", "saving money", "learning a new language", "gardening",
    "time management", "running a marathon", "caring for a dog", "keeping houseplants alive",
    "public speaking", "writing a resume", "job interviews", "making friends in a new city",
    "healthy breakfast ideas", "recycling", "camping", "packing for a trip", "meditation",
    "drinking enough water", "studying for exams", "moving to a new home", "riding a bicycle",
    # arts, culture, economics
    "jazz music", "impressionist painting", "poetry", "photography", "chess", "football",
    "the stock market", "inflation", "supply and demand", "small businesses", "coffee",
    "tea ceremonies", "libraries", "museums", "movies", "video games", "architecture",
    "fairy tales", "theatre", "volunteering", "mountains", "rivers", "islands", "trains",
)

# Templates with {t} for a topic.
TASKS = (
    "What is {t}?",
    "Explain {t} in simple terms.",
    "Explain {t} to a ten-year-old.",
    "Why is {t} important?",
    "How does {t} work?",
    "Give me three interesting facts about {t}.",
    "Write a short paragraph about {t}.",
    "List five key points about {t}.",
    "What are the main advantages and disadvantages of {t}?",
    "Summarize what people should know about {t} in a few sentences.",
    "Write a short story that involves {t}.",
    "Write a short poem about {t}.",
    "Write a friendly letter to a friend describing {t}.",
    "Write a dialogue between a teacher and a student about {t}.",
    "Give me some practical tips about {t}.",
    "What are common misconceptions about {t}?",
    "Describe the history of {t} briefly.",
    "Write a blog post introduction about {t}.",
    "What questions might a beginner ask about {t}? Answer two of them.",
    "Compare {t} with something similar and explain the differences.",
    "Write a short news report about a discovery related to {t}.",
    "Create a simple lesson plan to teach {t}.",
    "Describe {t} in exactly three sentences.",
    "What would the world be like without {t}?",
    "Write a product description for a book about {t}.",
)

# Stand-alone prompts: code and instructions that a topic template does not produce.
EXTRA = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function to count the words in a text file.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "Write a Python function that removes duplicates from a list while keeping order.",
    "Write a Python script that prints the multiplication table from 1 to 10.",
    "Write a JavaScript function that reverses an array.",
    "Write a SQL query that finds the ten most expensive products in a products table.",
    "Write a Python function that sorts a list of dictionaries by a given key.",
    "Write a Python function that converts Celsius to Fahrenheit, with a docstring.",
    "Write a bash command that counts the lines of every .py file in a folder.",
    "Explain what a for loop is, with an example in Python.",
    "Explain the difference between a list and a tuple in Python.",
    "How do I read a CSV file in Python?",
    "Write a Python function that checks if a number is prime.",
    "Write a haiku about autumn.",
    "Write a limerick about a cat.",
    "Give me a recipe for a simple vegetable soup.",
    "Plan a three-day trip to the seaside.",
    "Write a thank-you note to a colleague who helped me.",
    "Suggest five names for a new coffee shop.",
    "Write a motivational message for someone starting a new job.",
    "Describe a sunset over the ocean.",
    "Write the opening paragraph of a mystery novel.",
    "Give me a weekly exercise plan for a beginner.",
    "How can I improve my handwriting?",
    "What are good habits for staying focused while working from home?",
    "Write a short speech for a friend's birthday party.",
    "Tell me a fun fact about octopuses.",
    "Explain the rules of tic-tac-toe.",
)


def train_prompts(seed: int = 0) -> list[str]:
    """Every task template on every topic, plus the extra prompts, in a seeded order."""
    prompts = [task.format(t=topic) for topic in TOPICS for task in TASKS] + list(EXTRA)
    random.Random(seed).shuffle(prompts)
    return prompts


HELDOUT_PROMPTS = (
    "Please answer briefly.\n1. What makes bread rise?\n2. How do submarines dive and surface?\n"
    "3. Why do cats purr?",
    "I am visiting Lisbon next spring with my grandmother, who walks slowly. What should we plan "
    "for each day?",
    "You are a park ranger. A hiker asks you what to do if they meet a bear. Reply in character.",
    "My tomato plants have yellow leaves at the bottom. What could be wrong and what can I do?",
    "Quick questions:\n1. How far is the Sun from Earth?\n2. What is a leap year?\n3. Why does "
    "ice float on water?",
    "I keep forgetting people's names right after I meet them. Any advice?",
    "Pretend you are a tour guide in a museum of clocks. Introduce the first room to visitors.",
    "Answer in two sentences each.\n1. What is an eclipse?\n2. How do birds migrate?\n3. What is "
    "a fossil?",
    "My little brother asks why the sea is salty. How should I explain it to him?",
    "Tell the tale of a clumsy dragon who wants to become a baker.",
    "I have eggs, spinach, and some cheese. What can I make for dinner tonight?",
    "Riddle time: what has keys but cannot open locks? Explain the answer.",
    "Answer each:\n1. Who painted the Mona Lisa?\n2. What is the tallest mountain on Earth?\n3. "
    "How many legs does a spider have?",
    "I'm nervous about my first day teaching a class of teenagers. What should I do in the first "
    "lesson?",
    "You are a ship captain writing in your logbook during a storm. Write today's entry.",
    "Why do onions make people cry, and how can I avoid it when chopping them?",
    "Please explain, step by step, how a bill becomes a law in a parliament.",
    "My neighbour plays loud music at night. How can I ask them politely to stop?",
    "In a few lines each:\n1. What is a comet?\n2. How do glasses help people see?\n3. What does "
    "a lighthouse do?",
    "Describe a busy morning market in a small mountain village.",
    "What should I check before buying a used car?",
    "I want to start journaling. How do I begin and what should I write about?",
    "Imagine a robot that has just learned to paint. Describe its first painting.",
    "How do hot air balloons fly, and who flew the first one?",
    "Help me write an apology message to a friend whose party I missed.",
    "Explain like I'm five: how does a refrigerator keep food cold?",
    "Three questions about the ocean:\n1. How deep is it?\n2. What lives at the bottom?\n3. Why "
    "is it blue?",
    "A farmer must cross a river with a wolf, a goat and a cabbage. How does he do it?",
    "I'd like to learn to play the guitar at forty. Where should I start?",
    "Write a bedtime story about a snail who wants to see the world.",
    "What causes hiccups and how can they be stopped?",
    "You are a chef on a cooking show. Explain how to make pancakes to the audience.",
)
