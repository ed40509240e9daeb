"""Prompt sets for training a drafting head on the model's own answers (`head train`).

`train_prompts()` is a broad, deterministic list: task templates (questions, explanations,
instructions, lists, stories, poems, letters, dialogues, code, comparisons, advice) crossed with
topics from many fields, so the head sees the kinds of text a chat model writes.

`HELDOUT_PROMPTS` is a separate, hand-written set used only to measure acceptance: a different
style (several numbered questions in one message, first-person requests with a situation,
role-play, riddles), mostly on subjects outside the training topics; none of its prompts is in
the training list (`head train` checks), and none is one of the bench's workload texts
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


# A second check beside HELDOUT_PROMPTS, for choosing inference settings (the drafter's context
# bias) without fitting them to the held-out set: hand-written, none a training, held-out or
# bench prompt (tests/test_sidecar_probe.py); `head validation-shards` answers them.
VALIDATION_PROMPTS = (
    "My flatmate never washes the dishes. How do I raise it without starting a fight?",
    "Explain to a ten-year-old why the sky gets dark at night but the sun is still shining "
    "somewhere.",
    "What should I pack for a three-day hiking trip in autumn?",
    "Summarise the plot of Romeo and Juliet in five sentences.",
    "How does a bicycle stay upright when it moves?",
    "Write a short thank-you note to a teacher who helped me pass my maths exam.",
    "Why do we dream? Give the main theories.",
    "Plan a one-day walking tour of a small seaside town for a family with two kids.",
    "What is the difference between weather and climate? Keep it brief.",
    "Describe a busy train station at rush hour, in the present tense.",
    "You are a librarian. A student asks how to find good sources for an essay. Reply in "
    "character.",
    "Tell me a short fable about a turtle who wanted to fly, with a moral at the end.",
)

# Short factual questions, several to a message, answered as a terse numbered list: the style
# the first heads drafted worst on (a terse list is far from the paragraphs of TASKS). Written for
# this list; none is one of HELDOUT_PROMPTS' questions or the bench's (`head train` and
# tests/test_sidecar.py check).
TERSE_QUESTIONS = (
    # science
    "What is the boiling point of water at sea level?", "What gas do plants take in?",
    "Why do leaves change colour in autumn?", "What is an atom made of?",
    "How fast does light travel?", "What is the largest planet in the solar system?",
    "Why does the Moon have phases?", "What is a light-year?", "What causes thunder?",
    "How do magnets attract iron?", "What is the speed of sound in air?",
    "What is the chemical symbol for gold?", "Why do we have seasons?",
    "What is an enzyme?", "How many bones are in the adult human body?",
    "What does the liver do?", "What is the function of red blood cells?",
    "What is a chromosome?", "What is static electricity?", "How do fish breathe?",
    "Why is Mars red?", "What is the greenhouse effect?", "What is a neutron star?",
    "What is the difference between weather and climate?", "How do plants drink water?",
    "What is friction?", "What is an ecosystem?", "How does a rainbow form?",
    "What is absolute zero?", "Why do stars twinkle?", "What is a mammal?",
    "What are the three states of matter?", "What is osmosis?", "What is a catalyst?",
    "Why do we yawn?", "How do bats find their way in the dark?", "What is a galaxy?",
    "Why do our ears pop on a plane?", "What is the smallest planet?",
    "What is pH?", "How does the nose smell things?", "What is an allergy?",
    "Why does metal feel colder than wood?", "What is a food chain?",
    "How do chameleons change colour?", "What is erosion?", "What makes a diamond hard?",
    "What is carbon dating?", "How do earthworms help soil?", "What is a supernova?",
    # technology
    "What is RAM?", "What does an operating system do?", "What is an IP address?",
    "What is a compiler?", "How does Wi-Fi send data?", "What does HTTP stand for?",
    "What is a byte?", "What is open-source software?", "What is a firewall?",
    "How does a touchscreen sense a finger?", "What is a pixel?", "What is a URL?",
    "What does a graphics card do?", "What is binary code?", "What is a database index?",
    "What is phishing?", "What is a transistor?", "How does a microwave oven heat food?",
    "What is Bluetooth?", "What is two-factor authentication?", "What does a router do?",
    "What is an algorithm?", "What is a programming language?", "What is a QR code?",
    "How does a hard drive store data?", "What is a virus in computing?",
    "What is an API?", "What is the difference between hardware and software?",
    "What is a spreadsheet formula?", "What is a kilowatt-hour?", "How do LEDs make light?",
    "What is a barcode?", "What is streaming?", "What is an electric motor?",
    # history and people
    "Who was the first person to walk on the Moon?", "When did the Second World War end?",
    "Who invented the light bulb?", "What was the Magna Carta?",
    "Who was Cleopatra?", "When did the Berlin Wall fall?", "Who wrote Hamlet?",
    "What was the Bronze Age?", "Who discovered penicillin?", "Who was Napoleon?",
    "What were the pyramids of Giza built for?", "Who was Marie Curie?",
    "When was the first airplane flight?", "Who composed the Four Seasons?",
    "What was the Black Death?", "Who was Genghis Khan?", "What is the Rosetta Stone?",
    "Who painted the Sistine Chapel ceiling?", "Who developed the theory of relativity?",
    "When did Columbus first reach the Americas?", "Who was Nelson Mandela?",
    "What was the Apollo program?", "Who wrote The Odyssey?", "Who was Ada Lovelace?",
    "Who invented the printing press?", "What was the Ottoman Empire?",
    "Who was the first emperor of Rome?", "Who wrote War and Peace?",
    "Who was Isaac Newton?", "What was the Titanic?", "Who was Charles Darwin?",
    "Who built Machu Picchu?", "Who was Joan of Arc?", "What was the Gold Rush?",
    # geography
    "What is the capital of Australia?", "What is the longest river in the world?",
    "Which is the largest ocean?", "What is the largest desert?",
    "How many continents are there?", "What is the capital of Canada?",
    "Which country has the most people?", "What is the Amazon rainforest?",
    "Where is the Sahara?", "What is the smallest country in the world?",
    "What is the capital of Japan?", "Which river flows through Paris?",
    "What is the deepest lake?", "What language is spoken in Brazil?",
    "What is an archipelago?", "Where are the Andes?", "What is the equator?",
    "What is the capital of Kenya?", "Which country is shaped like a boot?",
    "What is a fjord?", "What is the Dead Sea?", "Where is Mount Kilimanjaro?",
    "What is the coldest place on Earth?", "What is a delta?",
    "Which countries share the longest border?", "What is a time zone?",
    # everyday life, food, health
    "How long should you boil an egg?", "Why does bread go stale?",
    "What is a calorie?", "Why do we need sleep?", "How much water should an adult drink?",
    "What is caffeine?", "Why does soap clean hands?", "What is yeast?",
    "How do you keep cut apples from browning?", "What is a balanced diet?",
    "Why do we get goosebumps?", "What is fibre in food?", "Why does popcorn pop?",
    "What is a fever?", "Why is exercise good for the heart?", "What is cholesterol?",
    "How do you treat a small burn?", "What is a vegan diet?", "Why do knees crack?",
    "What is a mortgage?", "What is compound interest?", "What is a budget?",
    "What is a credit score?", "What is a tax refund?", "What is insurance?",
    "How do you remove a coffee stain?", "Why do cut flowers wilt?",
    "What is composting?", "How often should you water a cactus?",
    # culture, language, sport, animals
    "What is a sonnet?", "What is a haiku?", "How many players are on a football team?",
    "What is a marathon distance?", "What is origami?", "Who is Sherlock Holmes?",
    "What is an orchestra?", "How many strings does a violin have?", "What is a novel?",
    "What is a metaphor?", "What is an opera?", "What is a synonym?", "What is a palindrome?",
    "What are the Olympic rings?", "What is a chess checkmate?", "What is ballet?",
    "How many keys does a piano have?", "What is a proverb?", "What is an encyclopedia?",
    "Why do zebras have stripes?", "How long do elephants live?", "What do pandas eat?",
    "How do penguins keep warm?", "Why do dogs wag their tails?", "How do bees make honey?",
    "What is the fastest land animal?", "Why do owls hunt at night?",
    "How do camels survive in the desert?", "What is a marsupial?",
    "Why do salmon swim upstream?", "How do frogs change as they grow?",
    "What is the largest animal ever?", "How do ants communicate?", "What is a reptile?",
    # maths and words
    "What is a prime number?", "What is pi?", "What is a percentage?",
    "What is the square root of 144?", "What is an average?", "What is a fraction?",
    "What is the Pythagorean theorem?", "How many degrees are in a triangle?",
    "What is a right angle?", "What is a hexagon?", "What is probability?",
    "What is a negative number?", "What is an equation?", "What is a decimal?",
)

# Headers that ask for the terse numbered answers (not the bench's own wording).
TERSE_HEADERS = (
    "Answer each question in one or two sentences.",
    "Answer each of these briefly.",
    "Give a short answer to each question.",
    "Please answer these in a numbered list, one or two sentences each.",
    "Short answers, please:",
    "Answer the following questions concisely.",
    "Reply to each question in a sentence or two.",
    "Answer these questions. Keep each answer short.",
    "Answer each question in two sentences.",
    "Quickly answer the following:",
    "Give brief, factual answers:",
    "Answer each question in a few words or a sentence.",
)


def terse_prompts(seed: int = 0, count: int = 384) -> list[str]:
    """`count` messages of 3-5 numbered questions from TERSE_QUESTIONS under a header asking
    for short answers, in a seeded order; each question is used about equally often."""
    rng = random.Random(seed + 7)
    pool: list[str] = []
    prompts: list[str] = []
    for _ in range(count):
        n = rng.choice((3, 4, 4, 5))
        picked: list[str] = []
        while len(picked) < n:
            if not pool:
                pool = list(TERSE_QUESTIONS)
                rng.shuffle(pool)
            q = pool.pop()
            if q not in picked:
                picked.append(q)
        lines = [rng.choice(TERSE_HEADERS)] + [f"{i}. {q}" for i, q in enumerate(picked, 1)]
        prompts.append("\n".join(lines))
    return prompts
