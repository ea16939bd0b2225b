"""The field-edit cases: a cached context with one field, and a question whose answer depends on it.

Each case renders as [system][user: facts, the field among them][assistant: "Noted."] (the cached context);
the question is the next user turn. `old`/`new` are the field's values, chosen to tokenize to the same count
on SmolLM2 and Qwen2.5 (so every way applies); `answers` are what a model that follows each value says.
"""

from __future__ import annotations

from dataclasses import dataclass

SYSTEM = "You are a precise assistant for an agent. Answer from the facts the user gave."


@dataclass(frozen=True)
class EditCase:
    name: str
    kind: str  # city, date, count, limit, tool_arg, setting
    facts: tuple[str, ...]  # lines of the user turn; exactly one holds "{v}", the field
    old: str
    new: str
    label: str  # for the erratum: "Correction: {label} is {new}, not {old}."
    question: str
    answers: tuple[str, str]  # what the answer contains when it follows old, new

    def messages(self, value: str) -> list[dict]:
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "\n".join(f.format(v=value) for f in self.facts)},
                {"role": "assistant", "content": "Noted."}]

    def field_span(self, text: str) -> tuple[int, int]:
        """Character span of the field's value in `text` (the context rendered with the old value)."""
        from kvtool.skills.edit import find_field

        line = next(f for f in self.facts if "{v}" in f)
        lo, _ = find_field(text, line.format(v=self.old))
        at = lo + line.index("{v}")
        return at, at + len(self.old)


def _c(name, kind, facts, old, new, label, question, answers=None) -> EditCase:
    return EditCase(name, kind, tuple(facts), old, new, label, question, answers or (old, new))


CASES: tuple[EditCase, ...] = (
    _c("weather_city", "city", ["User profile:", "- name: Ana", "- city: {v}", "- language: English",
                                "- units: metric", "The user asks about the weather where they live."],
       "Beijing", "Shanghai", "the user's city", "Which city should the weather be fetched for?"),
    _c("home_city", "city", ["Customer record:", "- customer id: 4711", "- home city: {v}", "- member since 2019",
                             "- prefers email contact"],
       "Paris", "London", "the customer's home city", "In which city does the customer live?"),
    _c("trip_destination", "city", ["Trip request:", "- traveller: Mei", "- destination: {v}", "- two nights",
                                    "- budget hotel"],
       "Madrid", "Rome", "the destination", "Where is the traveller going?"),
    _c("meeting_day", "date", ["Calendar note:", "- event: team meeting", "- day: {v}", "- time: 10:00",
                               "- room: B2"],
       "Monday", "Friday", "the meeting day", "On which day is the team meeting?"),
    _c("flight_month", "date", ["Booking:", "- passenger: Omar", "- flight month: {v}", "- seat: any",
                                "- bags: one"],
       "March", "April", "the flight month", "In which month does Omar fly?"),
    _c("deadline", "date", ["Project status:", "- project: Atlas", "- deadline: {v}", "- owner: Lena",
                            "- progress: 60 percent"],
       "2024-03-14", "2024-05-20", "the deadline", "What is the deadline of project Atlas?"),
    _c("tickets", "count", ["Order summary:", "- event: concert", "- tickets booked: {v}", "- paid by card",
                            "- delivery: e-mail"],
       "3", "1", "the number of tickets booked", "How many tickets are booked?"),
    _c("retries", "count", ["Job state:", "- job: nightly backup", "- retries left: {v}", "- last error: timeout",
                            "- queue: default"],
       "5", "2", "the number of retries left", "How many retries are left for the job?"),
    _c("budget", "count", ["Shopping task:", "- item: office chair", "- budget: {v} dollars", "- colour: black",
                           "- deliver to the office"],
       "100", "900", "the budget", "What is the budget in dollars?"),
    _c("phone_limit", "limit", ["<agent_status>", "phone_call: {v} calls made (max 3)", "web_search: 1 call made",
                                "time: 14:05", "</agent_status>"],
       "3/3", "1/3", "the phone_call count", "May the agent place another phone call? Answer yes or no.",
       ("no", "yes")),
    _c("search_limit", "limit", ["<agent_status>", "web_search: {v} calls made (max 2)", "phone_call: 0 calls made",
                                 "time: 09:40", "</agent_status>"],
       "2/2", "0/2", "the web_search count", "May the agent run another web search? Answer yes or no.",
       ("no", "yes")),
    _c("weather_tool_city", "tool_arg", ["Tool available: get_weather(city).", "The user says: I am in {v} today.",
                                         "They want to know if they need an umbrella."],
       "Tokyo", "Berlin", "the user's current city",
       "Which value should the city argument of get_weather have?"),
    _c("weather_tool_units", "tool_arg", ["Tool available: get_weather(city, units).", "User settings:",
                                          "- units: {v}", "- city: Oslo"],
       "celsius", "fahrenheit", "the units setting", "Which value should the units argument of get_weather have?"),
    _c("currency", "setting", ["Account settings:", "- currency: {v}", "- country code: 44", "- theme: dark"],
       "USD", "EUR", "the account currency", "In which currency should prices be shown?"),
    _c("language", "setting", ["User settings:", "- reply language: {v}", "- time zone: UTC", "- font: large"],
       "English", "French", "the reply language", "In which language should the assistant reply?"),
    _c("notifications", "setting", ["Preferences:", "- notifications: {v}", "- newsletter: monthly",
                                    "- theme: light"],
       "enabled", "disabled", "the notifications setting",
       "Should the agent send the user a push notification? Answer yes or no.", ("yes", "no")),
    _c("store_open", "setting", ["Store info:", "- name: Corner Books", "- status now: {v}",
                                 "- phone: 555 0100"],
       "open", "closed", "the store status", "Is Corner Books open right now? Answer yes or no.", ("yes", "no")),
    _c("diet", "setting", ["Guest profile:", "- guest: Priya", "- diet: {v}", "- allergies: none",
                           "- table for two"],
       "vegetarian", "vegan", "the guest's diet", "What diet does Priya follow?"),
    _c("seat", "setting", ["Travel preferences:", "- seat: {v}", "- meal: standard", "- loyalty number: 88812"],
       "window", "aisle", "the seat preference", "Which seat should be booked, window or aisle?"),
    _c("role", "limit", ["Access rules: only an admin may delete accounts.", "Current user:", "- login: kim",
                         "- role: {v}"],
       "admin", "guest", "the user's role", "May the current user delete accounts? Answer yes or no.",
       ("yes", "no")),
    _c("file_access", "limit", ["File policy:", "- file: report.txt", "- access: {v} only", "- owner: Sam"],
       "read", "write", "the file access", "What access does the agent have to report.txt, read or write?"),
    _c("customer_name", "setting", ["Support ticket:", "- customer: {v}", "- issue: login fails",
                                    "- priority: high"],
       "Alice", "Bob", "the customer's name", "What is the customer's name?"),
    _c("shipping_country", "city", ["Parcel:", "- weight: 2 kg", "- ship to: {v}", "- service: express"],
       "Canada", "Brazil", "the destination country", "Which country is the parcel shipped to?"),
    _c("transport", "tool_arg", ["Tool available: book_ticket(mode).", "The user prefers to travel by {v}.",
                                 "Trip: Lyon to Oslo, next week."],
       "train", "plane", "the travel mode", "Which value should the mode argument of book_ticket have?"),
    _c("delivery_slot", "date", ["Delivery:", "- order: 5521", "- slot: {v}", "- leave at the door"],
       "morning", "evening", "the delivery slot", "When will order 5521 be delivered, morning or evening?"),
)

SMOKE = ("weather_city", "phone_limit", "tickets")  # the handful the real-model tests run


def by_name(names) -> list[EditCase]:
    known = {c.name: c for c in CASES}
    missing = [n for n in names if n not in known]
    if missing:
        from kvtool.errors import InvalidParameterError

        raise InvalidParameterError(f"unknown edit case(s) {missing}; known: {', '.join(known)}")
    return [known[n] for n in names]
