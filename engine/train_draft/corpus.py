"""Offline prompts for training drafts, generated from templates with a seeded RNG (nothing is downloaded):
explanations, how-tos, code, arithmetic and algebra, JSON and other formats, stories, poems, summaries, emails,
lists, comparisons, arguments for and against, rewriting, definitions and chat; and the openers from which the
target writes requests itself (data.self_written_prompts).

The held-out set that training never sees is engine.workloads.heldout_prompts() (the benchmark workloads and
HELDOUT): training uses other subjects, tasks and phrasings, and `training_prompts` drops any prompt equal to a
held-out one.
"""
from __future__ import annotations

import random

from ..workloads import heldout_prompts

SUBJECTS = [
    "photosynthesis", "the water cycle", "binary search", "hash tables", "the French revolution", "compound interest",
    "black holes", "vaccines", "supply and demand", "plate tectonics", "recursion", "the stock market",
    "neural networks", "climate change", "the immune system", "volcanoes", "electric cars", "the printing press",
    "prime numbers", "gravity", "bees", "cloud computing", "the Roman empire", "sleep", "coffee", "solar panels",
    "chess openings", "version control", "public key cryptography", "the human heart", "rainbows", "inflation",
    "the internet", "DNA", "earthquakes", "the moon landing", "evolution", "the industrial revolution", "tides",
    "antibiotics", "blockchains", "machine learning", "the Renaissance", "the periodic table", "interest rates",
    "wind turbines", "the ozone layer", "operating systems", "compilers", "databases", "sorting algorithms",
    "the nervous system", "glaciers", "the Silk Road", "democracy", "the speed of light", "magnets", "bread baking",
    "coral reefs", "the Great Wall of China", "quantum computing", "the seasons", "memory in computers",
    "recycling", "the stomach", "rain forests", "the Olympic games", "the electoral college", "batteries",
    "jet engines", "the pyramids of Egypt", "taxes", "probability", "statistics", "the Pythagorean theorem",
    "encryption", "caching", "garbage collection", "TCP and UDP", "HTTP", "the solar system", "meditation",
    "nutrition", "exercise", "the Cold War", "the Amazon river", "deserts", "migration of birds", "photography",
    "jazz", "the violin", "impressionist painting", "Shakespeare", "the Moon", "Mars", "comets", "nuclear energy",
    "hydroelectric dams", "the carbon cycle", "fermentation", "the metric system", "time zones", "GPS",
    "credit scores", "budgeting", "open source software", "unit testing", "regular expressions", "linked lists",
    "graphs in computer science", "dynamic programming", "the binary number system", "logic gates", "transistors",
]
AUDIENCES = ["a ten-year-old", "a busy manager", "a first-year student", "an expert", "my grandmother",
             "a high school class", "a software engineer", "someone who has never heard of it", "a tourist"]
TASKS = [
    "reverses a string", "checks whether a number is prime", "counts the vowels in a string",
    "merges two sorted lists", "computes the factorial of n", "flattens a nested list",
    "finds the largest element of a list", "removes duplicates from a list while keeping order",
    "converts Celsius to Fahrenheit", "checks whether a string is a palindrome",
    "returns the greatest common divisor of two integers", "sums the digits of an integer",
    "counts word frequencies in a text", "transposes a matrix", "implements binary search",
    "validates an email address with a regular expression", "computes a moving average",
    "parses a CSV line into fields", "rotates a list by k positions", "implements a stack class",
    "implements a queue with two stacks", "computes the power set of a set", "generates all permutations of a list",
    "checks whether parentheses are balanced", "converts a decimal number to binary", "finds the median of a list",
    "counts the lines in a file", "computes the dot product of two vectors", "multiplies two matrices",
    "finds the second largest number in a list", "capitalizes the first letter of every word",
    "checks whether a year is a leap year", "computes the least common multiple of two numbers",
    "finds all prime numbers below n with a sieve", "implements bubble sort", "implements merge sort",
    "implements insertion sort", "computes the Levenshtein distance between two strings",
    "finds the longest common prefix of a list of strings", "groups a list of words by their first letter",
    "reads a JSON file and prints its keys", "implements a binary search tree with insert and search",
    "performs a breadth-first search on a graph", "performs a depth-first search on a graph",
    "computes the n-th triangular number", "converts a Roman numeral to an integer", "counts set bits in an integer",
    "splits a list into chunks of size n", "finds the intersection of two lists", "shuffles a list in place",
    "computes the area of a circle", "returns the n largest values of a list", "implements a simple LRU cache",
    "checks whether two rectangles overlap", "formats a number with thousands separators",
    "computes the mean and standard deviation of a list", "removes whitespace from both ends of a string",
    "converts a string to title case", "finds the missing number in a list from 1 to n",
]
LANGUAGES = ["Python", "JavaScript", "C", "C++", "Rust", "Go", "Java", "TypeScript", "Bash", "Ruby", "Kotlin", "Swift"]
NAMES = ["Alice", "Bob", "Chen", "Dana", "Emeka", "Fatima", "Giulia", "Hiro", "Ines", "Jonas", "Kofi", "Lena", "Maya",
         "Nikolai", "Olga", "Pedro", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yusuf", "Zoe"]
ITEMS = ["apples", "books", "pencils", "marbles", "cookies", "stamps", "tickets", "coins", "shells", "cards", "eggs",
         "stickers", "oranges", "toy cars", "candles", "bottles", "balloons", "flowers", "buttons", "crayons"]
OBJECTS = ["a book", "a movie", "a product", "a city", "a recipe", "a laptop", "a company", "a song", "a planet",
           "a restaurant", "a car", "a board game", "a museum", "a hiking trail", "a smartphone", "a sports team",
           "an employee", "a hotel", "a student", "a flight", "a painting", "a podcast", "an animal", "a country"]
FIELDS = [("title", "string"), ("year", "integer"), ("rating", "number"), ("tags", "[string]"), ("price", "number"),
          ("in_stock", "boolean"), ("author", "string"), ("country", "string"), ("population", "integer"),
          ("ingredients", "[string]"), ("id", "integer"), ("description", "string"), ("color", "string"),
          ("weight_kg", "number"), ("features", "[string]"), ("founded", "integer"), ("website", "string"),
          ("address", "string"), ("phone", "string"), ("available", "boolean"), ("genre", "string"),
          ("duration_minutes", "integer"), ("reviews", "[string]"), ("category", "string")]
CHARACTERS = ["a lonely lighthouse keeper", "a young dragon", "a detective cat", "a girl who can talk to birds",
              "an old fisherman", "a time-travelling teacher", "a shy giant", "two rival chefs", "a lost astronaut",
              "a clockmaker's apprentice", "a brave mouse", "a forgetful wizard", "a street musician",
              "a knight afraid of the dark", "a family of otters", "a retired pirate", "a curious penguin",
              "a boy who finds a magic map", "an android librarian", "a village baker"]
EVENTS = ["finds a hidden door", "has to save the town", "goes on a long journey", "makes an unexpected friend",
          "loses something precious", "enters a competition", "discovers a secret", "gets lost in a storm",
          "learns to fly", "opens a small shop", "wakes up a hundred years later", "solves an old mystery"]
THEMES = ["the ocean", "a rainy morning", "friendship", "the city at night", "mountains", "the first snow",
          "a quiet library", "spring flowers", "the stars", "an old house", "a train journey", "the desert",
          "a cup of tea", "summer holidays", "a forest path", "the wind", "growing older", "a lighthouse", "home"]
FORMS = ["a short poem", "a four-line poem", "a limerick", "a rhyming couplet", "a free-verse poem", "a sonnet",
         "a short song"]
DEBATES = ["social media", "nuclear power", "electric scooters", "homework", "school uniforms", "remote learning",
           "a four-day work week", "self-driving cars", "living in a big city", "owning a dog", "online shopping",
           "renting versus buying a home", "learning a second language early", "video games", "public transport",
           "space exploration", "open-plan offices", "cash-free payments", "tiny houses", "a vegetarian diet"]
ACTIVITIES = ["bake bread", "change a bicycle tire", "start running", "learn to play guitar", "plant tomatoes",
              "make a budget", "write a CV", "prepare for a job interview", "clean a laptop keyboard",
              "brew coffee with a French press", "set up a home network", "learn to swim", "start a podcast",
              "organize a closet", "fold a paper airplane", "make pancakes", "study for an exam", "save money",
              "improve my handwriting", "take better photos with a phone", "train a puppy", "reduce food waste"]
CATEGORIES = ["fruits that are high in vitamin C", "programming languages for beginners", "famous scientists",
              "countries in South America", "healthy breakfast ideas", "board games for families", "rivers in Europe",
              "classic novels", "ways to relax after work", "musical instruments", "uses of baking soda",
              "indoor plants that are easy to care for", "things to pack for a camping trip", "sorting algorithms",
              "inventions of the 20th century", "ideas for a birthday party", "animals that live in the Arctic",
              "tips for writing clear emails", "common data structures", "hobbies you can start at home"]
RECIPIENTS = ["my manager", "a colleague", "a customer", "my landlord", "a teacher", "a new team member",
              "the city council", "a hotel", "a supplier", "an old friend"]
REQUESTS = ["asking for a day off", "thanking them for their help", "rescheduling a meeting", "reporting a broken heater",
            "asking for feedback on a report", "welcoming them to the team", "complaining about a late delivery",
            "requesting a refund", "inviting them to a party", "following up on an unanswered question"]
SENTENCES = ["the meeting was moved to next week because several people were sick",
             "our sales went up a lot this quarter thanks to the new product",
             "the train was late so I missed the start of the concert",
             "I think we should try a different approach to this problem",
             "the new park in the city center is very popular with families",
             "please send me the documents before Friday",
             "the software update fixed the bug but made the app slower",
             "she has been learning to paint for three years",
             "the weather was terrible but we still enjoyed the trip",
             "we need more volunteers for the weekend event"]
STYLES = ["more formal", "simpler", "more polite", "shorter", "more enthusiastic", "more persuasive"]
TARGET_LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch"]
SKILLS = ["public speaking", "cooking", "time management", "writing", "chess", "drawing", "negotiating", "coding",
          "remembering names", "staying focused", "learning vocabulary", "making friends in a new city"]
CHAT = ["Hi! How are you today?", "Can you recommend a good book to read this weekend?",
        "I feel stressed about my exams. Any advice?", "What should I cook for dinner tonight?",
        "Tell me a fun fact about space.", "What's a good way to start learning to draw?",
        "Can you help me plan a trip to Japan?", "Give me three tips for staying productive.",
        "Tell me a joke about programmers.", "What is the difference between weather and climate?",
        "I can't sleep. What should I do?", "What are you able to help me with?", "Tell me something interesting.",
        "I just got a new puppy! Any advice?", "Can you suggest a weekend activity for a rainy day?"]

def _explain(rng: random.Random) -> str:
    s = rng.choice(SUBJECTS)
    return rng.choice([
        f"Explain {s} to {rng.choice(AUDIENCES)}.",
        f"Give a short overview of {s} in {rng.randint(3, 7)} bullet points.",
        f"What are the most common misconceptions about {s}?",
        f"Write a short paragraph about the history of {s}.",
        f"Compare {s} and {rng.choice(SUBJECTS)}.",
        f"What is {s}?",
        f"Why is {s} important?",
        f"How does {s} work? Keep it simple.",
        f"Describe {s} in one paragraph.",
        f"Give me {rng.randint(3, 5)} interesting facts about {s}.",
        f"Write a quiz of {rng.randint(3, 5)} questions about {s}, with answers.",
    ])


def _code(rng: random.Random) -> str:
    task, lang = rng.choice(TASKS), rng.choice(LANGUAGES)
    return rng.choice([
        f"Write a {lang} function that {task}.",
        f"Implement a {lang} program that {task}, with comments.",
        f"Write a {lang} function that {task}, and show an example call.",
        f"How would you write code that {task} in {lang}? Explain the approach and give the code.",
        f"Write {lang} code that {task}. Add a few unit tests.",
        f"What is the time complexity of a function that {task}? Give a {lang} implementation.",
        f"Write a short {lang} script that {task}.",
        f"Show me how to write a {lang} function that {task}, step by step.",
    ])


def _arithmetic(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 60), rng.randint(2, 12), rng.randint(1, 40)
    name, other, item = rng.choice(NAMES), rng.choice(NAMES), rng.choice(ITEMS)
    return rng.choice([
        f"What is {a} * {b} + {c}? Show your work.",
        f"{name} has {a} {item}. {other} gives {name} {b} times as many, then {name} loses {c}. "
        f"How many {item} does {name} have? Solve it step by step.",
        f"A shop sells {item} at {b} dollars each. {name} buys {a} and pays with {a * b + c} dollars. "
        f"How much change does {name} get? Explain.",
        f"If a train travels {a * 10} km in {b} hours, what is its average speed? Show the steps.",
        f"Compute the sum of the integers from 1 to {a}, step by step.",
        f"Solve for x: {b}x + {c} = {b * a + c}. Show each step.",
        f"{name} reads {b} pages a day. How many days does {name} need for a book of {a * b + c} pages?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        f"What is {c}% of {a * 10}? Explain how you got it.",
        f"{name} saves {b} dollars every week. After {a} weeks {name} spends {c} dollars. How much is left?",
        f"A recipe needs {b} eggs for {c % 6 + 2} people. How many eggs are needed for {a} people?",
        f"Is {a * b + 1} a prime number? Explain your reasoning.",
        f"Convert {a * 60 + c} minutes into hours and minutes.",
    ])


def _formats(rng: random.Random) -> str:
    fields = rng.sample(FIELDS, rng.randint(3, 5))
    schema = ", ".join(f'"{k}": {t}' for k, t in fields)
    obj = rng.choice(OBJECTS)
    return rng.choice([
        f"Emit only a JSON object that follows this schema: {{{schema}}}. Describe {obj}.",
        f"Return a JSON array of {rng.randint(2, 4)} objects with the fields {{{schema}}}, describing "
        f"fictional examples of {obj}.",
        f"Convert this to JSON with keys name and age: {rng.choice(NAMES)} is {rng.randint(18, 90)} years old.",
        f"Output a JSON object describing {obj} with the keys {', '.join(k for k, _ in fields)}. No prose.",
        f"Write a YAML document describing {obj} with the fields {', '.join(k for k, _ in fields)}.",
        f"Make a markdown table of {rng.randint(3, 5)} fictional examples of {obj} with the columns "
        f"{', '.join(k for k, _ in fields)}.",
        f"Write CSV data with a header row for {rng.randint(3, 6)} examples of {obj}: "
        f"{', '.join(k for k, _ in fields)}.",
    ])


def _story(rng: random.Random) -> str:
    who, what = rng.choice(CHARACTERS), rng.choice(EVENTS)
    return rng.choice([
        f"Write a short story about {who} who {what}.",
        f"Tell a bedtime story about {who}.",
        f"Write the opening paragraph of a novel about {who} who {what}.",
        f"In {rng.randint(3, 6)} sentences, tell a story in which {who} {what}.",
        f"Write a fable about {who}, ending with a moral.",
        f"Give me a plot outline for a film about {who} who {what}.",
        f"Describe the main character of a story about {who}.",
    ])


def _poem(rng: random.Random) -> str:
    theme = rng.choice(THEMES)
    return rng.choice([
        f"Write {rng.choice(FORMS)} about {theme}.",
        f"Compose {rng.choice(FORMS)} on the theme of {theme}.",
        f"Write a poem about {theme} for a child.",
        f"Write song lyrics about {theme}.",
    ])


def _argue(rng: random.Random) -> str:
    d = rng.choice(DEBATES)
    return rng.choice([
        f"List the advantages and disadvantages of {d}.",
        f"Give two arguments for and two against {d}.",
        f"Is {d} a good idea? Give a balanced answer.",
        f"Write a short persuasive paragraph in favour of {d}.",
        f"Write a short persuasive paragraph against {d}.",
        f"What do critics say about {d}, and how do supporters reply?",
    ])


def _howto(rng: random.Random) -> str:
    act = rng.choice(ACTIVITIES)
    return rng.choice([
        f"How do I {act}? Give step-by-step instructions.",
        f"What are the most common mistakes people make when they {act}?",
        f"Give me a simple plan to {act} this week.",
        f"I want to {act}. Where should I start?",
        f"Write a checklist for people who want to {act}.",
    ])


def _lists(rng: random.Random) -> str:
    cat = rng.choice(CATEGORIES)
    return rng.choice([
        f"List {rng.randint(3, 10)} {cat}.",
        f"Name {rng.randint(3, 7)} {cat} and say one thing about each.",
        f"Give me a numbered list of {cat}.",
        f"What are some {cat}?",
    ])


def _writing(rng: random.Random) -> str:
    sentence = rng.choice(SENTENCES)
    return rng.choice([
        f"Write a short email to {rng.choice(RECIPIENTS)} {rng.choice(REQUESTS)}.",
        f"Draft a polite message to {rng.choice(RECIPIENTS)} {rng.choice(REQUESTS)}.",
        f"Rewrite this sentence to be {rng.choice(STYLES)}: \"{sentence}.\"",
        f"Translate into {rng.choice(TARGET_LANGUAGES)}: \"{sentence}.\"",
        f"Fix the grammar and punctuation: \"{sentence.replace(' the ', ' teh ', 1)}\"",
        f"Summarize this in a few words: \"{sentence}.\"",
        f"Write a headline for a news article that begins: \"{sentence.capitalize()}.\"",
        f"Write a product description for {rng.choice(OBJECTS)} in {rng.randint(2, 4)} sentences.",
        f"Write a short speech for {rng.choice(['a wedding', 'a retirement party', 'a graduation', 'a team launch'])}.",
    ])


def _chat(rng: random.Random) -> str:
    return rng.choice(CHAT + [
        f"How can I get better at {rng.choice(SKILLS)}?",
        f"Any tips for {rng.choice(SKILLS)}?",
        f"I'm bored. Can you suggest something to do with {rng.choice(THEMES)} as a theme?",
        f"What do you think about {rng.choice(DEBATES)}?",
        f"My friend {rng.choice(NAMES)} says {rng.choice(SUBJECTS)} is boring. How can I convince them otherwise?",
    ])


KINDS = (_explain, _code, _arithmetic, _formats, _story, _poem, _argue, _howto, _lists, _writing, _chat)


# First words of user requests that the target writes itself (train-draft's self-written prompts): the target
# continues each into a whole request, sampled, so the requests range as widely as the target's own knowledge.
OPENERS = ("Write", "Explain", "How do I", "What is", "Can you", "Give me", "Summarize", "Create", "List", "Why",
           "Describe", "Compare", "I need", "Tell me", "What are", "Help me", "Solve", "Translate", "Rewrite",
           "Generate", "Is it", "Should I", "Design", "Implement", "Calculate", "Plan", "Suggest", "Classify",
           "Fix", "Convert", "Draft", "Outline", "Imagine", "Find", "Please", "")


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """n distinct prompts (as many as the templates allow) cycling over the kinds, never a held-out one."""
    rng = random.Random(seed)
    held = set(heldout_prompts().values())
    seen, out = set(), []
    for attempt in range(n * 50):
        prompt = KINDS[attempt % len(KINDS)](rng)
        if prompt not in seen and prompt not in held:
            seen.add(prompt)
            out.append(prompt)
            if len(out) == n:
                break
    return out
