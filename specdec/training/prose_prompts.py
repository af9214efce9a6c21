"""Training and validation prompts in natural language: hand-written topics times task templates.

The stdlib prompts (specdec/training/stdlib_prompts.py) are all coding instructions, so a head
trained on them alone has never seen the draft and target agree (or disagree) on prose. These
prompts ask for explanations, blog posts, stories, emails, tips, questions and answers about
everyday, scientific, historical and cultural topics:

    A curious twelve-year-old asks you about the water cycle. Explain it in simple words.
    Write a short story in which learning to ride a bicycle plays a central role.

They are written out here because the machines that make training data have no network (only
PyPI), and no prose data set ships in a package we use. Every topic is a grammatically singular
noun phrase (or a gerund phrase) that does not begin a sentence, so that every template reads
correctly with every topic ("why does {topic} matter?").

Ids are `prose:{template_key}:{topic_slug}`; order and split come from the hash of the id, by the
same rule as the stdlib prompts (`hash_split`). The held-out prose TEST set for benchmarks
(`PROSE_TEST_PROMPTS` in specdec/prompts.py) is written separately, on topics disjoint from these;
a test checks that none of its prompts mentions a topic below.
"""

from __future__ import annotations

import re

from specdec.training.stdlib_prompts import Prompt, hash_split

SOURCE_NAME = "prose"

# Each turns a topic into a request of a different kind; none starts with the topic, and each
# reads correctly with a singular noun phrase.
TEMPLATES = {
    "explain-child": "A curious twelve-year-old asks you about {topic}. Explain it in simple words.",
    "blog-post": "Write a short blog post about {topic}.",
    "misconceptions": "What are the most common misconceptions about {topic}? Answer in a few paragraphs.",
    "email": "Write a friendly email to a colleague summarising what you know about {topic}.",
    "story": "Write a short story in which {topic} plays a central role.",
    "tips": "Give five practical tips for someone who wants to learn more about {topic}, "
            "each with one sentence of explanation.",
    "teacher": "Answer as a teacher would: why does {topic} matter?",
    "newspaper": "Summarise what a newspaper reader should know about {topic}, in one paragraph.",
    "questions": "Write five questions a beginner might ask about {topic}, each followed by a short answer.",
    "dialogue": "Write a short dialogue between two friends talking about {topic}.",
    "poem": "Write a short poem about {topic}.",
}

TOPICS = (
    # science
    "the water cycle", "photosynthesis", "the cause of ocean tides", "the monthly cycle of the Moon",
    "the theory of evolution", "the structure of the atom", "the speed of light", "gravity",
    "the greenhouse effect", "the human immune system", "the discovery of penicillin",
    "the formation of rainbows", "plate tectonics", "the life cycle of a star", "the periodic table",
    "the role of DNA in heredity", "the Big Bang theory", "static electricity", "vaccination",
    "the science of sleep", "the nature of black holes", "bird migration", "the cause of the seasons",
    "magnetism", "the human heart", "antibiotic resistance", "the scientific method", "climate change",
    "the ozone layer", "radioactivity", "the search for life on other planets",
    # nature
    "the life of honeybees", "the Amazon rainforest", "the health of coral reefs", "hibernation",
    "the ecosystem of a pond", "the changing colour of autumn leaves", "the extinction of the dinosaurs",
    "the role of fungi in a forest", "octopus intelligence", "the survival of plants in the desert",
    "the life cycle of a butterfly", "the return of wolves to Yellowstone", "the importance of wetlands",
    "deforestation", "the melting of Arctic sea ice", "urban wildlife",
    # history
    "the French Revolution", "the fall of the Roman Empire", "the invention of the printing press",
    "the Industrial Revolution", "the building of the pyramids of Giza", "the Silk Road",
    "the Renaissance in Florence", "the age of the Vikings", "the moon landing of 1969",
    "the fall of the Berlin Wall", "the Black Death", "the history of the Olympic Games",
    "ancient Greek democracy", "the Magna Carta", "the abolition of slavery",
    "the women's suffrage movement", "the Cold War", "the Ottoman Empire", "the Meiji Restoration in Japan",
    "the history of the postal service", "the invention of writing", "the Age of Exploration",
    # geography
    "the river Nile", "the Himalayan mountain range", "the Sahara Desert", "the volcanic landscape of Iceland",
    "the monsoon in South Asia", "the Mediterranean climate", "the Panama Canal",
    "life at a research station in Antarctica", "the Grand Canyon", "the geography of Japan",
    "the Mississippi River", "the Australian outback",
    # everyday life
    "learning to ride a bicycle", "keeping a tidy home", "moving to a new city", "making friends as an adult",
    "managing a household budget", "planning a birthday party", "caring for houseplants",
    "adopting a dog from a shelter", "commuting by public transport", "sharing a flat with roommates",
    "recycling at home", "getting a good night's sleep", "decluttering a wardrobe", "learning to drive a car",
    "gardening on a balcony", "raising a teenager",
    # cooking
    "baking sourdough bread", "the history of pizza", "cooking the perfect pot of rice",
    "making fresh pasta by hand", "fermentation in the kitchen", "the Mediterranean diet",
    "brewing a good cup of coffee", "the history of chocolate", "cooking with seasonal vegetables",
    "basic knife technique in the kitchen", "the tradition of afternoon tea", "meal planning for a busy week",
    "the history of the spice trade", "vegetarian cooking",
    # health
    "the benefit of regular exercise", "staying hydrated", "managing stress", "healthy eating on a budget",
    "the importance of hand washing", "good posture at a desk", "recovering from a cold",
    "walking every day", "mental health at work", "first aid for minor burns", "eye strain from screens",
    # sport
    "the offside rule in football", "training for a marathon", "the history of cricket",
    "learning to swim as an adult", "the Tour de France", "the strategy of chess", "teamwork in basketball",
    "the Paralympic movement", "indoor rock climbing", "the culture of sumo wrestling", "the serve in tennis",
    "a daily yoga practice",
    # arts
    "the art of Vincent van Gogh", "Impressionism", "Gothic cathedral architecture", "street photography",
    "ancient Greek sculpture", "the history of animation", "the rise of street art",
    "the Bauhaus school of design", "learning to draw portraits", "the theatre of Shakespeare's time",
    "silent cinema",
    # music
    "the history of jazz", "learning to play the piano", "the music of Beethoven", "the origin of the blues",
    "singing in a choir", "the layout of a symphony orchestra", "the rise of hip hop",
    "the effect of music on mood", "Irish folk music", "Italian opera",
    # literature
    "the work of Jane Austen", "the play Hamlet", "the Epic of Gilgamesh", "the origin of fairy tales",
    "the history of science fiction", "the poetry of Emily Dickinson", "the novel Don Quixote",
    "keeping a reading journal", "the detective novel", "Greek mythology", "writing a memoir",
    # economics
    "inflation", "the law of supply and demand", "compound interest", "the role of a central bank",
    "saving for retirement", "the gig economy", "international trade", "the history of money",
    "starting a small business", "the stock market",
    # work
    "preparing for a job interview", "working from home", "giving constructive feedback",
    "running an effective meeting", "negotiating a salary", "changing careers in mid-life",
    "managing your time at work", "writing a good CV", "leading a small team", "avoiding burnout",
    # education
    "studying for exams", "homeschooling", "the value of a liberal arts education", "online learning",
    "the Montessori method", "taking good notes in lectures", "homework in primary school",
    # travel
    "travelling on a tight budget", "backpacking through Southeast Asia", "jet lag",
    "the etiquette of tipping abroad", "planning a first trip to Paris", "travelling by night train",
    "packing light for a long trip", "camping in the wilderness",
    # technology for lay people
    "the workings of the internet", "choosing a strong password", "cloud storage", "the smartphone camera",
    "the electric car", "GPS navigation", "artificial intelligence in everyday life", "online privacy",
    "3D printing", "solar power", "recognising a phishing email", "the history of the telephone",
    # language
    "the origin of the English language", "the difference between a dialect and a language",
    "sign language", "the history of the alphabet", "learning a second language", "slang among teenagers",
    "the art of translation", "the loss of endangered languages",
    # psychology
    "procrastination", "the power of habit", "intrinsic motivation", "human memory", "confirmation bias",
    "the psychology of happiness", "forming first impressions", "loneliness in old age",
    "language development in toddlers", "decision fatigue", "empathy", "the placebo effect",
    # society and ideas
    "the debate about free will", "volunteering in the community", "the importance of voting",
    "the role of a jury in a trial",
)


def topic_slug(topic: str) -> str:
    """"the women's suffrage movement" -> "the-women-s-suffrage-movement"."""
    return re.sub(r"[^a-z0-9]+", "-", topic.lower()).strip("-")


def prose_texts() -> dict[str, str]:
    """Every topic x template request, by id `prose:{template_key}:{topic_slug}`."""
    return {f"{SOURCE_NAME}:{key}:{topic_slug(topic)}": template.format(topic=topic)
            for key, template in TEMPLATES.items() for topic in TOPICS}


def prose_prompts(validation_fraction: float) -> list[Prompt]:
    """All prompts, in hash order, each tagged with its split (the stdlib prompts' rule)."""
    return hash_split(prose_texts(), validation_fraction)


def source_description(count: int) -> str:
    """The string the manifest records: what the prompts are and where they came from."""
    return (f"{SOURCE_NAME}: hand-written natural-language requests, {len(TOPICS)} topics x "
            f"{len(TEMPLATES)} task templates (specdec/training/prose_prompts.py), {count} prompts")
