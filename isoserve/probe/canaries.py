"""Victim prompts dense with canaries, and the scan that looks for them in other tenants' output.

A canary is a string that exists nowhere but in one victim's prompt of this run: a person or
company name built from random syllables, an invoice number, a euro amount, a due date, a
source file path, a line of code, an API-key-like secret, an agent work-log line. The kinds are
those of the incident (names, invoice numbers and amounts, file paths, agent logs). They are
generated fresh from the run's seed, so a hit in another tenant's output cannot be a
coincidence of training data.

The scan is exact (case-insensitive substring of the canary, or of any 12-character window of
its random core) and fuzzy (the best-aligned window of the output against the canary, difflib ratio, the
way `partial_ratio` works), on canaries of at least 8 characters.
"""
from __future__ import annotations

import difflib
import random
import string
from dataclasses import dataclass

MIN_FRAGMENT = 8        # shorter canaries (a bare amount, say) are scanned exactly only
WINDOW = 12             # exact scan: any window of this many characters of a long canary
FUZZY_THRESHOLD = 0.88  # fuzzy scan: best window's difflib ratio

_SYLLABLES = ("ka", "lo", "mi", "zu", "re", "ta", "vo", "ni", "sha", "qui", "dro", "bel", "yan",
              "fen", "gor", "wix", "ul", "ost", "pra", "ime", "zed", "lun", "cas", "tor")
_FIRST = ("Yusuf", "Marta", "Ingrid", "Tomasz", "Aiko", "Chidi", "Leonor", "Rafael", "Noor",
          "Henrik", "Priya", "Mateus", "Solveig", "Kwame", "Elif", "Dmitri")
_COMPANY_SUFFIX = ("GmbH", "B.V.", "S.A.", "Ltd", "AG", "Oy", "S.r.l.", "ApS")
_TOOLS = ("pytest -k", "git bisect run", "psql -c", "kubectl rollout restart", "terraform apply -target",
          "curl -X POST", "rg -n", "make -C")


@dataclass(frozen=True)
class Canary:
    kind: str    # person | company | invoice | amount | due_date | iban | path | code | secret | log
    value: str
    owner: str   # the tenant whose prompt it is in
    random_part: str = ""  # its high-entropy core: any 12-character window of it is a hit


@dataclass
class CanaryHit:
    canary: Canary
    match: str      # the text found in the output
    score: float    # 1.0 for an exact hit
    exact: bool

    def to_json(self) -> dict:
        return {"kind": self.canary.kind, "canary": self.canary.value, "owner": self.canary.owner,
                "match": self.match, "score": round(self.score, 3), "exact": self.exact}


class CanaryFactory:
    def __init__(self, rng: random.Random):
        self.rng = rng

    def word(self, syllables: int = 3) -> str:
        return "".join(self.rng.choice(_SYLLABLES) for _ in range(syllables))

    def person(self) -> str:
        return (f"{self.rng.choice(_FIRST)} {self.word(3).capitalize()}-"
                f"{self.word(2).capitalize()}")

    def company(self) -> str:
        return f"{self.word(3).capitalize()} {self.word(2).capitalize()} {self.rng.choice(_COMPANY_SUFFIX)}"

    def invoice(self) -> str:
        return f"INV-{self.rng.randrange(2026, 2029)}-{self.rng.randrange(10**5, 10**6)}"

    def amount(self) -> str:
        return f"€{self.rng.randrange(1000, 99999):,}.{self.rng.randrange(100):02d}"

    def due_date(self) -> str:
        return f"{self.rng.randrange(2026, 2029)}-{self.rng.randrange(1, 13):02d}-{self.rng.randrange(1, 29):02d}"

    def iban(self) -> str:
        return "DE" + "".join(self.rng.choice(string.digits) for _ in range(20))

    def path(self, company: str) -> str:
        slug = company.split()[0].lower()
        return f"/srv/{slug}/billing/{self.word(2)}_{self.rng.getrandbits(24):06x}.py"

    def secret(self) -> str:
        alphabet = string.ascii_letters + string.digits
        return "sk-live-" + "".join(self.rng.choice(alphabet) for _ in range(32))


def victim_prompt(rng: random.Random, owner: str, approx_tokens: int,
                  chars_per_token: float = 1.4) -> tuple[str, list[Canary]]:
    """A prompt of about `approx_tokens` tokens made of canary-dense records, and its canaries.
    Digits and rare names tokenize densely: measure `chars_per_token` on the server when it can.

    Each record is one customer: a CRM note, an invoice, the code that bills it with a secret,
    and an agent's work log -- what a tenant of an inference service really sends.
    """
    f = CanaryFactory(rng)
    canaries: list[Canary] = []
    parts: list[str] = []
    chars = 0
    while chars < chars_per_token * approx_tokens:
        person, company, invoice, amount = f.person(), f.company(), f.invoice(), f.amount()
        due, iban, path, secret = f.due_date(), f.iban(), f.path(company), f.secret()
        func = f"reconcile_{f.word(2)}_{rng.getrandbits(32):08x}"
        code = f"def {func}(ledger): return ledger.charge({invoice!r}, api_key={secret!r})"
        run = f"{f.word(2)}-{rng.getrandbits(32):08x}"
        log = f"[agent {run}] step {rng.randrange(2, 40)}: patched {path}, ran `{rng.choice(_TOOLS)} {f.word(2)}`"
        record = (f"Customer {person} of {company}. Invoice {invoice} over {amount} is due on {due}; "
                  f"pay to IBAN {iban}.\nSource {path}:\n{code}\n{log}\n")
        parts.append(record)
        chars += len(record)
        for kind, value, core in (("person", person, ""), ("company", company, ""), ("invoice", invoice, ""),
                                  ("amount", amount, ""), ("due_date", due, ""), ("iban", iban, iban[2:]),
                                  ("path", path, path.rsplit("/", 1)[-1]), ("code", func, func[10:]),
                                  ("secret", secret, secret[8:]), ("log", run, run)):
            canaries.append(Canary(kind, value, owner, core))
    return "".join(parts), canaries


def scan(text: str, canaries: list[Canary], *, fuzzy_threshold: float = FUZZY_THRESHOLD) -> list[CanaryHit]:
    """Canaries found in `text`, best hit per canary."""
    if not text:
        return []
    lowered = text.lower()
    hits = []
    for c in canaries:
        hit = _exact(lowered, text, c) or _fuzzy(lowered, text, c, fuzzy_threshold)
        if hit is not None:
            hits.append(hit)
    return hits


def _exact(lowered: str, text: str, c: Canary) -> CanaryHit | None:
    """The whole canary, or any 12-character window of its random core (a secret, an IBAN's
    digits, a file name, ...), case-blind."""
    value = c.value.lower()
    if value in lowered and len(value) >= 6:
        i = lowered.index(value)
        return CanaryHit(c, text[i:i + len(value)], 1.0, True)
    core = c.random_part.lower()
    for start in range(0, max(0, len(core) - WINDOW) + 1):
        window = core[start:start + WINDOW]
        if len(window) >= MIN_FRAGMENT and window in lowered:
            i = lowered.index(window)
            return CanaryHit(c, text[i:i + len(window)], 1.0, True)
    return None


def _fuzzy(lowered: str, text: str, c: Canary, threshold: float) -> CanaryHit | None:
    """partial_ratio, case-blind: align the canary with the output on each matching block and
    score the window of the output it lands on."""
    value = c.value.lower()
    if len(value) < MIN_FRAGMENT or len(lowered) < MIN_FRAGMENT:
        return None
    matcher = difflib.SequenceMatcher(None, value, lowered, autojunk=False)
    if matcher.quick_ratio() * (len(value) + len(lowered)) / (2 * min(len(value), len(lowered))) < threshold:
        return None  # not enough characters in common for any window to reach the threshold
    best, best_window = 0.0, ""
    for i, j, size in matcher.get_matching_blocks():
        if size < 3:
            continue
        start = max(0, j - i)
        window = lowered[start:start + len(value)]
        score = difflib.SequenceMatcher(None, value, window, autojunk=False).ratio()
        if score > best:
            best, best_window = score, text[start:start + len(value)]
    if best >= threshold:
        return CanaryHit(c, best_window, best, False)
    return None
