"""Generator of the shipped voice-agent prompt set (ttsbuild/data/voice_agent.jsonl).

Replies in the shape a voice agent speaks them: one to three sentences, 15 to 250 characters,
a mean near 90, over bookings, support, directions, numbers, dates and times, short
confirmations and questions back to the user. Written for this project from templates and
slot vocabularies (no text copied from anywhere); a fixed seed makes the file reproducible:

    python -m ttsbuild.bench.voice_agent_prompts > ttsbuild/data/voice_agent.jsonl

The bench reads only the data file; this module exists so the file can be regenerated and so
a test can check the file is what the generator makes.
"""

from __future__ import annotations

import json
import random
import re
import sys

SEED = 12
COUNT = 720
MIN_CHARS, MAX_CHARS = 15, 250
MAX_SENTENCES = 3
_SENTENCE_END = re.compile(r"(?<!\bDr)[.!?](?=\s|$)")  # "Dr." abbreviates; it ends nothing

# -- slot vocabularies ------------------------------------------------------------------------
SLOTS: dict[str, list[str]] = {
    "name": ["Maria", "James", "Priya", "Tom", "Aisha", "Daniel", "Mei", "Carlos", "Olivia",
             "Noah", "Fatima", "Lucas", "Hannah", "Ravi", "Sofia", "Ethan"],
    "weekday": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
    "month": ["January", "February", "March", "April", "May", "June", "July", "August",
              "September", "October", "November", "December"],
    "day": ["1st", "2nd", "3rd", "4th", "5th", "8th", "9th", "12th", "14th", "17th", "20th",
            "21st", "23rd", "26th", "28th", "30th"],
    "time": ["9 AM", "9:30 AM", "10:15 AM", "11 AM", "noon", "12:45 PM", "1:30 PM", "2 PM",
             "3:15 PM", "4:45 PM", "5:30 PM", "6 PM", "7:15 PM", "8 PM", "8:30 PM"],
    "party": ["two", "three", "four", "five", "six", "eight"],
    "venue": ["the Harbor Grill", "Luna Trattoria", "the Green Table", "Sakura House",
              "the Oak Room", "Casa Verde", "the Blue Door Cafe", "Mangrove Kitchen"],
    "hotel": ["the Riverside Inn", "the Grand Plaza", "Parkview Suites", "the Lakeside Lodge",
              "the Metro Hotel"],
    "room": ["a king room", "two queen beds", "a junior suite", "a standard double",
             "an ocean-view room"],
    "nights": ["one night", "two nights", "three nights", "four nights", "a week"],
    "clinic": ["Dr. Patel", "Dr. Nguyen", "Dr. Alvarez", "Dr. Brooks", "the dental office",
               "the eye clinic"],
    "service": ["a haircut", "an oil change", "a cleaning", "a consultation",
                "a tire rotation", "a massage", "a check-up"],
    "city": ["Chicago", "Denver", "Boston", "Seattle", "Atlanta", "Austin", "Toronto",
             "Miami", "Phoenix", "Portland"],
    "airline_flight": ["flight 2841", "flight 317", "flight 1190", "flight 58", "flight 906"],
    "gate": ["B12", "C7", "A23", "D4", "E18"],
    "item": ["pair of headphones", "pair of running shoes", "coffee maker", "phone case",
             "desk lamp", "set of towels", "blender", "winter jacket", "printer cartridge",
             "yoga mat"],
    "order": ["4471-2209", "88315", "A-20937", "650112", "7Q-4418", "31207"],
    "amount": ["$12.99", "$24.50", "$7", "$139", "$58.20", "$1,250", "$3.75", "$89.99",
               "$412.10", "$19"],
    "days_n": ["two", "three", "three to five", "five to seven", "ten"],
    "digits": ["4821", "0093", "7765", "1304", "5590", "2218"],
    "phone": ["555-0142", "555-0187", "(312) 555-0199", "1-800-555-0123", "555-0166"],
    "street": ["Main Street", "Oak Avenue", "5th Street", "Elm Road", "Park Boulevard",
               "Market Street", "Lincoln Way", "River Drive"],
    "landmark": ["the gas station", "the library", "a big red barn", "the post office",
                 "the second traffic light", "the pharmacy", "the roundabout"],
    "distance": ["half a mile", "two blocks", "about 300 feet", "a quarter mile",
                 "1.2 miles", "three miles"],
    "minutes": ["five", "ten", "fifteen", "twenty", "twenty-five", "forty"],
    "direction": ["left", "right"],
    "plan": ["the Basic plan", "the Plus plan", "the Family plan", "the Premium plan"],
    "percent": ["10%", "15%", "20%", "25%", "5%"],
    "temp": ["68 degrees", "72 degrees", "54 degrees", "81 degrees", "39 degrees"],
    "weather": ["sunshine", "clouds", "light rain", "clear skies", "strong wind",
                "a chance of snow"],
    "device": ["the router", "your phone", "the app", "the thermostat", "your laptop",
               "the smart speaker"],
    "setting": ["Settings", "Account", "Privacy", "Notifications", "Billing"],
    "topic": ["your bill", "the delivery", "your reservation", "the warranty",
              "your password", "the refund"],
    "count": ["two", "three", "four", "five", "seven", "twelve"],
    "code": ["739 204", "115 862", "480 317", "926 051"],
    "email_hint": ["ending in gmail.com", "that starts with the letter J",
                   "on file for this account", "ending in outlook.com"],
}

# -- reply parts --------------------------------------------------------------------------------
OPENERS = [
    "Sure.", "Of course.", "Got it.", "Okay.", "Absolutely.", "No problem.", "Great.",
    "Thanks for waiting.", "Let me check.", "One moment.", "Perfect.", "Alright.",
    "Thanks, {name}.", "Happy to help.", "I see.", "Good news.", "Sorry about that.",
]

CORE = {
    "booking": [
        "I have a table for {party} at {venue} on {weekday} at {time}.",
        "Your reservation at {venue} is confirmed for {time} on {weekday}.",
        "I can book {room} at {hotel} for {nights}, starting {month} {day}.",
        "The earliest opening with {clinic} is {weekday} at {time}.",
        "I've moved your appointment to {weekday}, {month} {day}, at {time}.",
        "You're booked for {service} on {weekday} at {time}.",
        "{venue} is full at {time}, but they can seat {party} at {time}.",
        "Your stay at {hotel} is {nights}, checking in on {month} {day}.",
        "I've cancelled the {time} booking and released the table for {party}.",
        "There are {count} slots left on {weekday}, the first at {time}.",
        "Your total for {nights} at {hotel} comes to {amount} before taxes.",
        "I reserved {service} with {clinic} for {month} {day} at {time}.",
        "I checked with {venue}, and they can fit {party} at {time} on {weekday}, but only "
        "on the patio, since the dining room is fully booked that evening.",
        "Your appointment with {clinic} is on {weekday}, {month} {day}, at {time}. Please "
        "arrive ten minutes early and bring your insurance card and a photo ID.",
        "I found {room} at {hotel} for {nights} at {amount} a night, with free cancellation "
        "up to two days before you arrive and breakfast included.",
    ],
    "support": [
        "Your order {order} shipped today and should arrive in {days_n} business days.",
        "I've issued a refund of {amount} to your original payment method.",
        "The {item} from order {order} is back-ordered until {month} {day}.",
        "I reset your password and sent a link to the email {email_hint}.",
        "Your account is on {plan}, billed at {amount} a month.",
        "Try restarting {device}, then wait about {minutes} seconds before reconnecting.",
        "Open {setting} and turn the switch off and on again.",
        "I've applied a {percent} discount, so your new total is {amount}.",
        "The return window for the {item} closes on {month} {day}.",
        "Your refund should show up within {days_n} business days.",
        "I can see a charge of {amount} on {month} {day} for {plan}.",
        "Your verification code is {code}.",
        "I've opened a ticket about {topic}, and a specialist will call you back.",
        "The {item} is covered by the warranty, so the replacement is free.",
        "I upgraded you to {plan} at no extra cost for the first month.",
        "It looks like {device} lost its connection around {time}.",
        "Unplug {device}, wait {minutes} seconds, plug it back in, and give the lights about "
        "two minutes to turn solid green before you try again.",
        "Since the {item} arrived damaged, I've sent a prepaid return label to the email "
        "{email_hint}, and the replacement ships as soon as the carrier scans the package.",
        "Your bill this month is {amount}, which is higher than usual because it includes a "
        "one-time activation fee and a partial month of {plan}.",
        "The refund of {amount} was approved on {month} {day}, and depending on your bank it "
        "can take {days_n} business days to appear on your statement.",
    ],
    "directions": [
        "Head north on {street} for {distance}, then turn {direction} at {landmark}.",
        "Turn {direction} onto {street} and the entrance is on your {direction}.",
        "You're about {minutes} minutes away, so you should arrive around {time}.",
        "Go past {landmark} and take the next {direction}.",
        "The parking garage is on {street}, {distance} past {landmark}.",
        "Your {airline_flight} to {city} boards at gate {gate} at {time}.",
        "Keep {direction} at the fork and stay on {street} for {distance}.",
        "The nearest location is on {street}, {distance} from you.",
        "After {distance} you'll pass {landmark} on your {direction}. The entrance is just "
        "after it, and visitor parking is behind the building.",
        "Your {airline_flight} to {city} is delayed by {minutes} minutes, so boarding now "
        "starts at {time} from gate {gate}, and your connection in {city} is still protected.",
        "Traffic is heavy on {street}, so I'd take {street} instead.",
        "Gate {gate} is a {minutes} minute walk from security.",
    ],
    "numbers": [
        "The number is {phone}.",
        "That comes to {amount}, including tax.",
        "Your balance is {amount}, and the payment is due on {month} {day}.",
        "The card ending in {digits} was charged {amount}.",
        "Your confirmation number is {order}.",
        "It's {temp} in {city} right now, with {weather} later today.",
        "You have {count} unread messages and one voicemail.",
        "The account ending in {digits} has a credit of {amount}.",
        "Tonight's forecast in {city} is {weather} with a low of {temp}.",
        "That's {count} items for a total of {amount}.",
        "Your current balance is {amount}. The minimum payment of {amount} is due on {month} "
        "{day}, and paying it in full by then avoids the {percent} late fee.",
    ],
    "dates": [
        "Your next delivery is on {weekday}, {month} {day}.",
        "The office is closed on {month} {day} and reopens {weekday} at {time}.",
        "Your subscription renews on {month} {day}.",
        "The event starts at {time} on {weekday}.",
        "Your lease ends on {month} {day}, so we should renew by {weekday}.",
        "Pickup is ready any time after {time} on {weekday}.",
        "I set a reminder for {weekday} at {time}.",
        "Your trial runs until {month} {day}, and you won't be charged before then.",
        "The contractor can come on {weekday} between {time} and {time}, or the following "
        "week on {month} {day}, and the visit takes about {minutes} minutes.",
    ],
}

QUESTIONS = [
    "Does that work for you?", "Would you like me to book it?", "Is there anything else?",
    "Should I send a confirmation by text?", "Can I help with anything else today?",
    "What time works best for you?", "Would you prefer {weekday} or {weekday}?",
    "Can you confirm the last four digits of your card?", "What's the best number to reach you?",
    "Do you want me to add that to your calendar?", "Shall I go ahead?",
    "Would you like the directions sent to your phone?", "How many people will be joining?",
    "Can you tell me the order number?", "Is this for {party} people?",
    "Would you like a window seat?", "Do you want to keep the same payment method?",
    "Could you spell your last name for me?", "What city are you traveling from?",
    "Should I check {weekday} as well?",
]

SHORT_REPLIES = [
    "Got it, thanks.", "Sure, one moment please.", "Okay, I'll take care of that.",
    "Yes, that's right.", "No, that slot is taken.", "Done. Anything else?",
    "Thanks, {name}. You're all set.", "Perfect, see you then.", "Let me look that up.",
    "Sorry, could you repeat that?", "I didn't catch the last part.", "All set for {time}.",
    "Confirmed for {weekday}.", "You're welcome, {name}.", "Sure thing.", "Yes, we're open.",
    "That's {amount}.", "Okay, cancelled.", "Hold on, I'm checking now.", "Great, booked.",
    "Have a good {weekday}!", "Your code is {code}.", "It's gate {gate}.",
    "Okay, noted.", "Right away.", "Goodbye, {name}!",
]

# (parts, weight): the mix that puts the mean near 90 characters
SHAPES = [
    (("short",), 14),
    (("core",), 22),
    (("opener", "core"), 18),
    (("core", "question"), 22),
    (("opener", "core", "question"), 12),
    (("core", "core"), 7),
    (("question",), 5),
]


def sentences(text: str) -> int:
    return len(_SENTENCE_END.findall(text))


def _fill(template: str, rng: random.Random) -> str:
    out, rest = [], template
    while "{" in rest:
        head, _, tail = rest.partition("{")
        key, _, rest = tail.partition("}")
        out.append(head + rng.choice(SLOTS[key]))
    return "".join(out) + rest


def _part(kind: str, domain: str, rng: random.Random) -> str:
    pool = {"short": SHORT_REPLIES, "opener": OPENERS, "question": QUESTIONS}.get(kind)
    text = _fill(rng.choice(pool if pool else CORE[domain]), rng)
    return text[0].upper() + text[1:]  # a slot may open the sentence ("the Oak Room is...")


def generate(count: int = COUNT, seed: int = SEED) -> list[dict[str, str]]:
    """`count` distinct replies, each {"text", "domain"}, in generation order."""
    rng = random.Random(seed)
    shapes, weights = zip(*SHAPES, strict=True)
    domains = sorted(CORE)
    seen: set[str] = set()
    out: list[dict[str, str]] = []
    while len(out) < count:
        shape = rng.choices(shapes, weights)[0]
        domain = rng.choice(domains)
        text = " ".join(_part(kind, domain, rng) for kind in shape)
        if text in seen or not MIN_CHARS <= len(text) <= MAX_CHARS:
            continue
        if sentences(text) > MAX_SENTENCES:
            continue
        if shape in (("short",), ("question",)):
            domain = "short" if shape == ("short",) else "question"
        seen.add(text)
        out.append({"text": text, "domain": domain})
    return out


def to_jsonl(records: list[dict[str, str]]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


if __name__ == "__main__":
    sys.stdout.write(to_jsonl(generate()))
