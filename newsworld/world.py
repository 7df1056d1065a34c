"""The built-in news world: a seeded generator of short news articles with a fact table each.

Every article is built from an event of one of ten families (earnings,
acquisition, election, sports, court, storm, launch, research, funding,
council), with a fact table and a 2-4 sentence reference summary built from its
key facts. Distractor sentences reuse the article's own entities and numbers in
other roles (last year's revenue, a rival's bid), so careless copying errs.
Article i depends only on (seed, i): `documents(n, seed)` and
`world_document(seed, i)` are the entry points; `python -m newsworld generate` writes
them as Document JSONL. `oracle.py` checks any summary against the fact table.
`task="long"` gives the long task instead (LONG_WORDS below): news-length articles
whose key facts sit in joined sentences, and a reference that fuses them into a word
budget, so no copy of whole sentences states them (docs/long_task.md).

Its values, names and family building blocks are in `vocab.py`. No torch, no numpy.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import data
from factual_tools import textsplit
from data import MONTHS, DataError, Document, seeded_rng
from newsworld.vocab import (
    WORLD_VERSION, C, Cast, Ent, Family, Qty, S, Sent, U, When, DraftFact, Values, count, money, score, verb, when,
)


# ===========================================================================
# 3. The news world: event families
# ===========================================================================


# --- earnings --------------------------------------------------------------

def _make_earnings(r: random.Random) -> dict[str, DraftFact]:
    cast, v = Cast(r), Values(r)
    c, rival, ceo, an, bank, city = (cast.take(p) for p in ("company", "company", "person", "person", "firm", "city"))
    y = r.randint(2016, 2029)
    qm, qd = r.choice([(3, 31), (6, 30), (9, 30), (12, 31)])
    rev = v.big_money()
    growth = v.pct(2, 28)
    up = r.random() < 0.75
    exact = rev.amount / (1 + growth.amount / 100 if up else 1 - growth.amount / 100)
    tries = iter(range(1000))
    # The exact prior can print like a value already drawn (same rounded text):
    # then a value within 3% keeps the story coherent and every value distinct.
    prior = v.distinct(lambda: money(int(round(exact if next(tries) == 0 else exact * r.uniform(0.97, 1.03)))))
    return {
        "rev": DraftFact(c, value=rev, date=v.distinct(lambda: when(y, qm, qd))),
        "growth": DraftFact(c, value=growth, pred="rise" if up else "fall"),
        "prior": DraftFact(c, value=prior, date=v.distinct(lambda: when(y - 1, qm, qd))),
        "est": DraftFact(c, value=v.near(rev, 0.9, 1.1)),
        "rival": DraftFact(rival, value=v.near(rev, 0.4, 1.6)),
        "profit": DraftFact(c, value=v.near(rev, 0.04, 0.2)),
        "guidance": DraftFact(c, value=v.near(rev, 3.6, 4.6), date=v.distinct(lambda: when(y + 1))),
        "jobs": DraftFact(c, value=v.count(200, 6000, "jobs"), pred="cut" if r.random() < 0.6 else "add"),
        "shares": DraftFact(c, value=v.pct(1, 15), pred=r.choice(["rise", "fall"])),
        "ceo": DraftFact(ceo, obj=c),
        "analyst": DraftFact(an, obj=bank),
        "hq": DraftFact(c, obj=city),
        "founded": DraftFact(c, date=v.year(1990, 2012)),
    }


EARNINGS = Family(
    "earnings", _make_earnings,
    cues={
        "rev": C("revenue|sales", "quarter|quarterly|period|three months"),
        "growth": C("revenue|sales"),
        "prior": C("revenue|sales", "a year earlier|a year ago|previous year"),
        "est": C("analysts", "expected"),
        "rival": C("rival"),
        "profit": C("net profit|net income"),
        "guidance": C("expects|outlook"),
        "jobs": C("jobs"),
        "shares": C("shares"),
        "ceo": C("chief executive"),
        "analyst": C("analyst"),
        "hq": C("based|headquartered"),
        "founded": C("founded"),
    },
    lead=(
        S("rev growth",
          "{rev.subj}[hq:, which is based in {hq.obj},] reported revenue of {rev.value} for the quarter ended "
          "{rev.date}, as sales {growth.verb} {growth.value}.",
          "Revenue at {rev.subj} {growth.verb} {growth.value} to {rev.value} in the quarter ended {rev.date}"
          "[hq:, the {hq.obj}-based company said].",
          "In the three months to {rev.date}, sales at {rev.subj} {growth.verb} {growth.value} to {rev.value}."),
    ),
    body=(
        S("profit", "{profit.subj} said net profit came to {profit.value}.",
          "Net profit reached {profit.value}, the company said."),
        S("prior", "A year earlier, {prior.subj} had reported revenue of {prior.value} for the quarter ended "
                   "{prior.date}.",
          "That compares with revenue of {prior.value} in the quarter ended {prior.date}, a year earlier.",
          distractor=True),
        S("est", "Analysts had expected revenue of {est.value}.",
          "The result compared with the {est.value} that analysts had expected.", distractor=True),
        S("rival", "Rival {rival.subj} reported revenue of {rival.value} for the same period.",
          "{rival.subj}, its closest rival, posted revenue of {rival.value} last week.", distractor=True),
        S("jobs", "{jobs.subj} {jobs.verb} {jobs.value} over the next two years.",
          "{jobs.subj} also said it {jobs.verb} {jobs.value}."),
        S("shares", "Shares of {shares.subj} {shares.verb} {shares.value} in early trading.",
          "{shares.subj} shares {shares.verb} {shares.value} after the results were published."),
        S("guidance", "{guidance.subj} expects revenue of {guidance.value} for {guidance.date}.",
          "For {guidance.date}, the company expects revenue of about {guidance.value}."),
        S("ceo", "\"Demand was strong in every region,\" said {ceo.subj}, chief executive of {ceo.obj}.",
          "{ceo.subj}, the chief executive of {ceo.obj}, said the company would keep investing in new products."),
        S("analyst", "{analyst.subj}, an analyst at {analyst.obj}, said the results were better than many "
                     "investors had feared."),
        S("founded", "{founded.subj} was founded in {founded.date}[hq: and is based in {hq.obj}].",
          "Founded in {founded.date}, {founded.subj} makes most of its money abroad."),
    ),
    units=(
        U("lead", "rev growth",
          "{rev.subj} reported revenue of {rev.value} for the quarter ended {rev.date}, as sales {growth.verb} "
          "{growth.value}.",
          "Revenue at {rev.subj} {growth.verb} {growth.value} to {rev.value} in the quarter ended {rev.date}.",
          "Quarterly revenue at {rev.subj} {growth.verb} {growth.value} to {rev.value} in the period ended "
          "{rev.date}."),
        U("profit", "profit", "{profit.subj} reported a net profit of {profit.value}.",
          "Net profit at {profit.subj} came to {profit.value}."),
        U("jobs", "jobs", "{jobs.subj} {jobs.verb} {jobs.value} over the next two years.",
          "{jobs.subj} said it {jobs.verb} {jobs.value}."),
        U("guidance", "guidance", "{guidance.subj} expects revenue of {guidance.value} for {guidance.date}.",
          "For {guidance.date}, {guidance.subj} expects revenue of about {guidance.value}."),
        U("shares", "shares", "Shares of {shares.subj} {shares.verb} {shares.value} after the report.",
          "{shares.subj} shares {shares.verb} {shares.value} after the results."),
    ),
)


# --- acquisitions ----------------------------------------------------------

def _make_acquisition(r: random.Random) -> dict[str, DraftFact]:
    cast, v = Cast(r), Values(r)
    a, t, bidder, past_t = (cast.take("company") for _ in range(4))
    ceo_a, ceo_t, agency, city = cast.take("person"), cast.take("person"), cast.take("agency"), cast.take("city")
    y = r.randint(2016, 2029)
    price = v.big_money(1.5, 60)
    return {
        "deal": DraftFact(a, obj=t, value=price, date=v.date(y), pred="buy"),
        "premium": DraftFact(a, obj=t, value=v.pct(12, 60)),
        "close": DraftFact(a, obj=t, date=v.distinct(lambda: when(y + 1, r.randint(1, 12)))),
        "staff": DraftFact(t, value=v.count(800, 40000, "employees")),
        "bid": DraftFact(bidder, obj=t, value=v.near(price, 0.7, 0.95),
                         date=v.distinct(lambda: when(y - 1, r.randint(1, 12)))),
        "past": DraftFact(a, obj=past_t, value=v.near(price, 0.1, 0.6), date=v.year(y - 8, y - 2)),
        "reg": DraftFact(a, obj=agency, pred="require", polarity=r.random() < 0.6),
        "ceo_a": DraftFact(ceo_a, obj=a),
        "ceo_t": DraftFact(ceo_t, obj=t),
        "hq": DraftFact(t, obj=city),
        "shares_t": DraftFact(t, value=v.pct(5, 40), pred="rise"),
    }


ACQUISITION = Family(
    "acquisition", _make_acquisition,
    cues={
        "deal": C("acquire|buy|sell|divest"),
        "premium": C("premium"),
        "close": C("close"),
        "staff": C("employees"),
        "bid": C("bid|offered"),
        "past": C("previously"),
        "reg": C("approval"),
        "ceo_a": C("chief executive"),
        "ceo_t": C("founded|founder"),
        "hq": C("based|headquartered"),
        "shares_t": C("shares"),
    },
    lead=(
        S("deal", "{deal.subj} {deal.verb} {deal.obj}[hq:, which is based in {hq.obj},] for {deal.value} on "
                  "{deal.date}.",
          "On {deal.date}, {deal.subj} {deal.verb} {deal.obj} for {deal.value}[hq:, adding a business based in "
          "{hq.obj}]."),
    ),
    body=(
        S("premium", "The price is a premium of {premium.value} to the last closing price of {premium.obj}.",
          "{premium.subj} is paying a premium of {premium.value} for {premium.obj}."),
        S("close", "The deal for {close.obj} is expected to close in {close.date}.",
          "{close.subj} expects the purchase of {close.obj} to close in {close.date}."),
        S("staff", "{staff.subj} employs {staff.value}[hq: and is based in {hq.obj}].",
          "The deal brings {staff.value} from {staff.subj} into the group."),
        S("bid", "{bid.subj} had made a rival bid of {bid.value} for {bid.obj} in {bid.date}.",
          "In {bid.date}, {bid.subj} offered {bid.value} for {bid.obj}, a bid that was turned down.",
          distractor=True),
        S("past", "{past.subj} previously bought {past.obj} for {past.value} in {past.date}.",
          "In {past.date}, {past.subj} had previously paid {past.value} for {past.obj}.", distractor=True),
        S("reg", "The deal {reg.verb} approval from the {reg.obj}.",
          "The transaction {reg.verb} the approval of the {reg.obj}."),
        S("ceo_a", "\"This is a natural fit for both companies,\" said {ceo_a.subj}, chief executive of {ceo_a.obj}.",
          "{ceo_a.subj}, chief executive of {ceo_a.obj}, called the deal a natural fit."),
        S("ceo_t", "{ceo_t.subj}, who founded {ceo_t.obj}, will stay on to run the business.",
          "{ceo_t.obj} founder {ceo_t.subj} is expected to stay on."),
        S("shares_t", "Shares of {shares_t.subj} {shares_t.verb} {shares_t.value} on the news.",
          "{shares_t.subj} shares {shares_t.verb} {shares_t.value} after the announcement."),
    ),
    units=(
        U("lead", "deal", "{deal.subj} {deal.verb} {deal.obj} for {deal.value} on {deal.date}.",
          "On {deal.date}, {deal.subj} {deal.verb} {deal.obj} for {deal.value}."),
        U("premium", "premium", "{premium.subj} is paying a premium of {premium.value} for {premium.obj}."),
        U("close", "close", "The deal for {close.obj} is expected to close in {close.date}."),
        U("staff", "staff", "{staff.subj} employs {staff.value}."),
        U("reg", "reg", "The deal {reg.verb} approval from the {reg.obj}."),
        U("shares_t", "shares_t", "Shares of {shares_t.subj} {shares_t.verb} {shares_t.value} on the news."),
    ),
)


# --- elections -------------------------------------------------------------

def _make_election(r: random.Random) -> dict[str, DraftFact]:
    cast, v = Cast(r), Values(r)
    w, loser, prev = cast.take("person"), cast.take("person"), cast.take("person")
    party_w, party_l = cast.take("party"), cast.take("party")
    place = cast.take("city") if r.random() < 0.6 else cast.take("region")
    office = f"{'mayor' if place.type == 'city' else 'governor'} of {place.name}"
    y = r.randint(2016, 2030)
    share_w = v.pct(41, 68)
    return {
        "win": DraftFact(w, obj=place, value=share_w, date=v.date(y), pred="win", extra={"office": office}),
        "votes": DraftFact(w, value=v.count(12000, 900000, "votes", step=1)),
        "loser": DraftFact(loser, obj=party_l, value=v.pct(20, min(40.0, share_w.amount - 1))),
        "turnout": DraftFact(place, value=v.pct(35, 80)),
        "party": DraftFact(w, obj=party_w),
        "prev": DraftFact(prev, obj=place, date=v.year(y - 16, y - 5)),
        "prior": DraftFact(loser, value=v.pct(25, 60), date=v.distinct(lambda: when(y - 4))),
        "pledge": DraftFact(w, value=v.count(1000, 50000, "new homes", "homes", step=100)),
        "sworn": DraftFact(w, date=v.date(y)),
    }


ELECTION = Family(
    "election", _make_election,
    cues={
        "win": C("race|election"),
        "votes": C("votes"),
        "loser": C("second|runner-up"),
        "turnout": C("turnout"),
        "party": C("candidate"),
        "prev": C("held"),
        "prior": C("previous election"),
        "pledge": C("pledged|promised"),
        "sworn": C("sworn"),
    },
    lead=(
        S("win", "{win.subj} {win.verb} the race for {win.office} on {win.date} with {win.value} of the vote.",
          "{win.subj}[party:, the {party.obj} candidate,] {win.verb} the election for {win.office} on {win.date}, "
          "taking {win.value} of the vote."),
    ),
    body=(
        S("votes", "{votes.subj} received {votes.value}, according to official results.",
          "Official results gave {votes.subj} {votes.value}."),
        S("loser", "{loser.subj} of the {loser.obj} finished second with {loser.value}.",
          "The runner-up, {loser.subj} of the {loser.obj}, took {loser.value}."),
        S("turnout", "Turnout in {turnout.subj} was {turnout.value}, election officials said.",
          "Officials put turnout in {turnout.subj} at {turnout.value}."),
        S("party", "{party.subj} ran as the {party.obj} candidate."),
        S("prev", "{prev.subj}, who had held the post since {prev.date}, is retiring.",
          "The post had been held by {prev.subj} since {prev.date}."),
        S("prior", "In the previous election, in {prior.date}, {prior.subj} won {prior.value} of the vote.",
          "{prior.subj} had taken {prior.value} in the previous election in {prior.date}.", distractor=True),
        S("pledge", "During the campaign, {pledge.subj} promised to build {pledge.value}.",
          "{pledge.subj} has pledged to build {pledge.value}."),
        S("sworn", "{sworn.subj} will be sworn in on {sworn.date}.",
          "{sworn.subj} is due to be sworn in on {sworn.date}."),
    ),
    units=(
        U("lead", "win",
          "{win.subj} {win.verb} the race for {win.office} on {win.date} with {win.value} of the vote.",
          "On {win.date}, {win.subj} {win.verb} the election for {win.office} with {win.value} of the vote."),
        U("loser", "loser", "{loser.subj} finished second with {loser.value}."),
        U("votes", "votes", "{votes.subj} received {votes.value}."),
        U("turnout", "turnout", "Turnout in {turnout.subj} was {turnout.value}."),
        U("pledge", "pledge", "{pledge.subj} has pledged to build {pledge.value}."),
        U("sworn", "sworn", "{sworn.subj} will be sworn in on {sworn.date}."),
    ),
)


# --- sports results ----------------------------------------------------------

def _make_sports(r: random.Random) -> dict[str, DraftFact]:
    cast, v = Cast(r), Values(r)
    home, away = cast.take("team"), cast.take("team")
    star, hurt, coach, venue = cast.take("person"), cast.take("person"), cast.take("person"), cast.take("city")
    y = r.randint(2016, 2030)
    if r.random() < 0.5:  # football
        h = r.randint(2, 5)
        res, prev = score(h, r.randint(0, h - 1)), score(r.randint(3, 5), r.randint(0, 2))
        scored = count(r.randint(2, min(h, 3)), "goals")
    else:  # basketball
        h = r.randint(85, 130)
        res, prev = score(h, h - r.randint(1, 20)), score(r.randint(100, 125), r.randint(80, 99))
        scored = count(r.randint(18, 45), "points")
    return {
        "result": DraftFact(home, obj=away, value=res, date=v.date(y), pred="beat"),
        "scorer": DraftFact(star, obj=home, value=scored),
        "crowd": DraftFact(home, value=v.count(8000, 80000, None, "spectators")),
        "venue": DraftFact(home, obj=venue),
        "season": DraftFact(home, value=v.small(5, 30, "wins")),
        "prev": DraftFact(away, obj=home, value=prev, date=v.distinct(lambda: when(y - 1))),
        "coach": DraftFact(coach, obj=home),
        "injury": DraftFact(hurt, obj=away, pred="play", polarity=False),
    }


SPORTS = Family(
    "sports", _make_sports,
    cues={
        "result": C("beat|defeat|defeated|lost to|fell to|lose to|fall to"),
        "scorer": C("scored"),
        "crowd": C("crowd"),
        "venue": C("played in|hosted"),
        "season": C("this season"),
        "prev": C("previous meeting"),
        "coach": C("coach|coaches"),
        "injury": C("injury"),
    },
    lead=(
        S("result", "{result.subj} {result.verb} {result.obj} {result.value} on {result.date}[venue:, in a game "
                    "played in {venue.obj}].",
          "On {result.date}, {result.subj} {result.verb} {result.obj} {result.value}."),
    ),
    body=(
        S("scorer", "{scorer.subj} scored {scorer.value} for {scorer.obj}.",
          "{scorer.obj} were led by {scorer.subj}, who scored {scorer.value}."),
        S("crowd", "A crowd of {crowd.value} watched the game.", "The game drew a crowd of {crowd.value}."),
        S("venue", "{venue.subj} hosted the game in {venue.obj}.", "The game was played in {venue.obj}."),
        S("season", "The result gives {season.subj} {season.value} this season.",
          "{season.subj} now have {season.value} this season."),
        S("prev", "{prev.subj} had won the previous meeting {prev.value} in {prev.date}.",
          "In the previous meeting, in {prev.date}, {prev.subj} beat {prev.obj} {prev.value}.", distractor=True),
        S("coach", "\"We showed real belief tonight,\" said {coach.subj}, the coach of {coach.obj}.",
          "{coach.subj}, who coaches {coach.obj}, praised the defence."),
        S("injury", "{injury.subj} {injury.verb} for {injury.obj} because of an injury.",
          "{injury.obj} were without {injury.subj}, who {injury.verb} because of an injury."),
    ),
    units=(
        U("lead", "result", "{result.subj} {result.verb} {result.obj} {result.value} on {result.date}.",
          "On {result.date}, {result.subj} {result.verb} {result.obj} {result.value}."),
        U("scorer", "scorer", "{scorer.subj} scored {scorer.value} for {scorer.obj}."),
        U("crowd", "crowd", "A crowd of {crowd.value} watched the game."),
        U("season", "season", "{season.subj} now have {season.value} this season."),
        U("injury", "injury", "{injury.subj} {injury.verb} for {injury.obj} because of an injury."),
    ),
)


# --- court rulings -----------------------------------------------------------

def _make_court(r: random.Random) -> dict[str, DraftFact]:
    cast, v = Cast(r), Values(r)
    court, plaintiff, defendant, judge = cast.take("court"), cast.take("company"), cast.take("company"), cast.take("person")
    y = r.randint(2016, 2030)
    damages = v.millions(5, 900)
    return {
        "ruling": DraftFact(court, obj=plaintiff, other=defendant, date=v.date(y),
                     pred="rule_for" if r.random() < 0.8 else "rule_against"),
        "damages": DraftFact(defendant, obj=plaintiff, value=damages),
        "judge": DraftFact(judge, obj=court),
        "appeal": DraftFact(defendant, pred="appeal", polarity=r.random() < 0.6),
        "lower": DraftFact(plaintiff, value=v.near(damages, 0.3, 0.8), date=v.year(y - 5, y - 1)),
        "sought": DraftFact(plaintiff, value=v.near(damages, 1.5, 4.0)),
        "filed": DraftFact(plaintiff, obj=defendant, date=v.year(y - 9, y - 2)),
        "patents": DraftFact(plaintiff, value=v.small(2, 40, "patents")),
    }


COURT = Family(
    "court", _make_court,
    cues={
        "ruling": C("ruled|sided|rule|side"),
        "damages": C("damages"),
        "judge": C("judge"),
        "appeal": C("appeal"),
        "lower": C("lower court"),
        "sought": C("sought|asked for"),
        "filed": C("filed"),
        "patents": C("patents"),
    },
    lead=(
        S("ruling", "{ruling.subj} {ruling.verb} {ruling.obj} in its case against {ruling.other} on {ruling.date}.",
          "On {ruling.date}, {ruling.subj} {ruling.verb} {ruling.obj} in a dispute with {ruling.other}."),
    ),
    body=(
        S("damages", "{damages.subj} was ordered to pay {damages.value} in damages to {damages.obj}.",
          "The court ordered {damages.subj} to pay {damages.obj} {damages.value} in damages."),
        S("judge", "Judge {judge.subj} wrote the decision for {judge.obj}.",
          "The decision was written by Judge {judge.subj} of {judge.obj}."),
        S("appeal", "{appeal.subj} said it {appeal.verb} the decision.",
          "{appeal.subj} {appeal.verb} the decision, a spokesperson said."),
        S("lower", "A lower court had awarded {lower.subj} {lower.value} in {lower.date}.",
          "In {lower.date}, a lower court had awarded {lower.value} to {lower.subj}.", distractor=True),
        S("sought", "{sought.subj} had sought {sought.value}.",
          "{sought.subj} had asked for {sought.value} in the lawsuit.", distractor=True),
        S("filed", "{filed.subj} filed the lawsuit against {filed.obj} in {filed.date}.",
          "The lawsuit was filed by {filed.subj} against {filed.obj} in {filed.date}."),
        S("patents", "The case concerned {patents.value} held by {patents.subj}.",
          "At issue were {patents.value} owned by {patents.subj}."),
    ),
    units=(
        U("lead", "ruling",
          "{ruling.subj} {ruling.verb} {ruling.obj} in its case against {ruling.other} on {ruling.date}.",
          "On {ruling.date}, {ruling.subj} {ruling.verb} {ruling.obj} in its dispute with {ruling.other}."),
        U("damages", "damages", "{damages.subj} was ordered to pay {damages.value} in damages to {damages.obj}."),
        U("appeal", "appeal", "{appeal.subj} said it {appeal.verb} the decision."),
        U("filed", "filed", "{filed.subj} filed the lawsuit against {filed.obj} in {filed.date}."),
        U("patents", "patents", "The case concerned {patents.value} held by {patents.subj}."),
    ),
)


# --- storms ------------------------------------------------------------------

def _make_storm(r: random.Random) -> dict[str, DraftFact]:
    cast, v = Cast(r), Values(r)
    storm, old_storm, city, official, agency = (cast.take(p) for p in ("storm", "storm", "city", "person", "agency"))
    y = r.randint(2016, 2030)
    deaths = v.small(3, 180, "people")
    return {
        "hit": DraftFact(storm, obj=city, value=v.count(80, 180, "mph", step=5), date=v.date(y), pred="hit"),
        "deaths": DraftFact(storm, value=deaths, pred="kill"),
        "evac": DraftFact(storm, obj=city, value=v.count(2000, 250000, "residents", step=100)),
        "damage": DraftFact(storm, value=v.big_money(0.1, 12) if r.random() < 0.5 else v.millions(20, 900)),
        "power": DraftFact(storm, value=v.count(10000, 900000, "homes", step=100)),
        "official": DraftFact(official, obj=agency),
        "past": DraftFact(old_storm, value=v.small(5, 400, "people"), date=v.year(1990, y - 3)),
        "aid": DraftFact(agency, value=v.millions(5, 500)),
    }


STORM = Family(
    "storm", _make_storm,
    cues={
        "hit": C("hit|struck|strike|winds"),
        "deaths": C("killed|kill|killing|dead|lives"),
        "evac": C("evacuated"),
        "damage": C("damage"),
        "power": C("power"),
        "official": C("director"),
        "past": C("since"),
        "aid": C("aid"),
    },
    lead=(
        S("hit", "{hit.subj} {hit.verb} {hit.obj} on {hit.date} with winds of {hit.value}.",
          "With winds of {hit.value}, {hit.subj} {hit.verb} {hit.obj} on {hit.date}."),
    ),
    body=(
        S("deaths", "The storm {deaths.verb} {deaths.value}, officials said.",
          "Officials said {deaths.subj} {deaths.verb} {deaths.value}."),
        S("evac", "More than {evac.value} were evacuated from {evac.obj}.",
          "Authorities evacuated {evac.value} from {evac.obj} before the storm arrived."),
        S("damage", "Insurers put the damage at {damage.value}.",
          "{damage.subj} caused an estimated {damage.value} in damage."),
        S("power", "About {power.value} were left without power.",
          "Power was knocked out to {power.value} across the region."),
        S("official", "{official.subj}, director of the {official.obj}, said rescue teams were working through "
                      "the night."),
        S("past", "It was the deadliest storm in the region since {past.date}, when {past.subj} killed {past.value}.",
          "{past.subj} killed {past.value} in {past.date}, the worst toll in the region since records began.",
          distractor=True),
        S("aid", "The {aid.subj} released {aid.value} in emergency aid.",
          "Emergency aid of {aid.value} was approved by the {aid.subj}."),
    ),
    units=(
        U("lead", "hit", "{hit.subj} {hit.verb} {hit.obj} on {hit.date} with winds of {hit.value}.",
          "On {hit.date}, {hit.subj} {hit.verb} {hit.obj} with winds of {hit.value}."),
        U("deaths", "deaths", "{deaths.subj} {deaths.verb} {deaths.value}.", "The storm {deaths.verb} {deaths.value}."),
        U("evac", "evac", "More than {evac.value} were evacuated from {evac.obj}."),
        U("damage", "damage", "{damage.subj} caused an estimated {damage.value} in damage."),
        U("power", "power", "About {power.value} were left without power."),
    ),
)


# --- product launches ----------------------------------------------------------

def _make_launch(r: random.Random) -> dict[str, DraftFact]:
    cast, v = Cast(r), Values(r)
    c, product, rival, rival_product, ceo, city = (cast.take(p) for p in
                                                   ("company", "product", "company", "product", "person", "city"))
    y = r.randint(2016, 2030)
    m = r.randint(1, 10)
    return {
        "launch": DraftFact(c, obj=product, date=v.date(y, m), pred="launch"),
        "price": DraftFact(product, value=v.dollars(200, 2000)),
        "orders": DraftFact(c, value=v.count(20000, 2000000, "orders", step=1000)),
        "battery": DraftFact(product, value=v.small(8, 40, "hours")),
        "rival": DraftFact(rival, obj=rival_product, value=v.dollars(200, 2000)),
        "prev": DraftFact(c, value=v.dollars(200, 2000), date=v.year(y - 4, y - 1)),
        "ceo": DraftFact(ceo, obj=c),
        "ship": DraftFact(product, date=v.date(y, m + r.randint(1, 2))),
        "factory": DraftFact(c, obj=city),
    }


LAUNCH = Family(
    "launch", _make_launch,
    cues={
        "launch": C("launched|unveiled|cancelled|scrapped|launch|unveil|cancel|scrap"),
        "price": C("costs|priced"),
        "orders": C("orders"),
        "battery": C("battery"),
        "rival": C("rival"),
        "prev": C("previous model"),
        "ceo": C("chief executive"),
        "ship": C("on sale"),
        "factory": C("plant|factory"),
    },
    lead=(
        S("launch", "{launch.subj} {launch.verb} the {launch.obj} on {launch.date}[price:, priced at {price.value}].",
          "On {launch.date}, {launch.subj} {launch.verb} its new {launch.obj}[factory:, which is built at a plant in "
          "{factory.obj}]."),
    ),
    body=(
        S("price", "The {price.subj} costs {price.value}.", "The {price.subj} is priced at {price.value}."),
        S("orders", "{orders.subj} said it had received {orders.value} in the first week.",
          "The company has taken {orders.value} so far."),
        S("battery", "The {battery.subj} offers {battery.value} of battery life.",
          "Battery life on the {battery.subj} reaches {battery.value}."),
        S("rival", "Rival {rival.subj} sells its {rival.obj} for {rival.value}.",
          "The {rival.obj} from rival {rival.subj} sells for {rival.value}.", distractor=True),
        S("prev", "The previous model, released by {prev.subj} in {prev.date}, cost {prev.value}.",
          "In {prev.date}, the previous model from {prev.subj} sold for {prev.value}.", distractor=True),
        S("ceo", "\"This is the best device we have ever made,\" said {ceo.subj}, chief executive of {ceo.obj}.",
          "{ceo.subj}, chief executive of {ceo.obj}, called it the company's most important product."),
        S("ship", "The {ship.subj} goes on sale on {ship.date}.", "The {ship.subj} will be on sale from {ship.date}."),
        S("factory", "{factory.subj} builds the device at a plant in {factory.obj}."),
    ),
    units=(
        U("lead", "launch", "{launch.subj} {launch.verb} the {launch.obj} on {launch.date}.",
          "On {launch.date}, {launch.subj} {launch.verb} the {launch.obj}."),
        U("price", "price", "The {price.subj} costs {price.value}."),
        U("orders", "orders", "{orders.subj} has received {orders.value}."),
        U("battery", "battery", "The {battery.subj} offers {battery.value} of battery life."),
        U("ship", "ship", "The {ship.subj} goes on sale on {ship.date}."),
    ),
)


# --- research findings ------------------------------------------------------------

_CONDITIONS = ["heart disease", "migraine", "type 2 diabetes", "asthma attacks", "stroke", "kidney failure",
               "severe influenza", "liver disease", "hip fractures", "memory loss"]


def _make_research(r: random.Random) -> dict[str, DraftFact]:
    cast, v = Cast(r), Values(r)
    univ, lead, journal, drug, funder = (cast.take(p) for p in ("university", "person", "journal", "drug", "agency"))
    cond = r.choice(_CONDITIONS).replace("type 2 ", "")  # no stray digits in the condition
    y = r.randint(2016, 2030)
    return {
        "study": DraftFact(univ, obj=journal, date=v.date(y)),
        "finding": DraftFact(drug, value=v.pct(10, 60), pred="reduce" if r.random() < 0.8 else "increase",
                      extra={"condition": cond}),
        "people": DraftFact(univ, value=v.count(200, 12000, "participants")),
        "months": DraftFact(univ, value=v.small(6, 36, "months")),
        "lead": DraftFact(lead, obj=univ),
        "earlier": DraftFact(None, value=v.pct(5, 45), date=v.year(y - 10, y - 2), extra={"condition": cond}),
        "funding": DraftFact(funder, value=v.millions(2, 90)),
        "side": DraftFact(drug, value=v.pct(2, 20)),
    }


RESEARCH = Family(
    "research", _make_research,
    cues={
        "study": C("study"),
        "finding": C("risk"),
        "people": C("participants"),
        "months": C("months"),
        "lead": C("led"),
        "earlier": C("earlier study"),
        "funding": C("funded|grant"),
        "side": C("side effects"),
    },
    lead=(
        S("study finding",
          "A study by researchers at {study.subj}, published in the {study.obj} on {study.date}, found that "
          "{finding.subj} {finding.verb} the risk of {finding.condition} by {finding.value}.",
          "{finding.subj} {finding.verb} the risk of {finding.condition} by {finding.value}, according to a study "
          "by {study.subj} published in the {study.obj} on {study.date}."),
    ),
    body=(
        S("people months", "The trial followed {people.value} for {months.value}.",
          "Researchers tracked {people.value} over {months.value}."),
        S("lead", "The research was led by Dr. {lead.subj} of {lead.obj}.",
          "Dr. {lead.subj}, who led the team at {lead.obj}, called the result encouraging."),
        S("earlier", "An earlier study in {earlier.date} had found a {earlier.value} lower risk of "
                     "{earlier.condition}.",
          "In {earlier.date}, an earlier study had reported a risk reduction of {earlier.value}.", distractor=True),
        S("funding", "The work was funded by a {funding.value} grant from the {funding.subj}.",
          "The {funding.subj} funded the trial with a grant of {funding.value}."),
        S("side", "About {side.value} of participants taking {side.subj} reported mild side effects.",
          "Mild side effects were reported by {side.value} of those taking {side.subj}.", distractor=True),
    ),
    units=(
        U("lead", "study finding",
          "A study by {study.subj} published in the {study.obj} on {study.date} found that {finding.subj} "
          "{finding.verb} the risk of {finding.condition} by {finding.value}.",
          "{finding.subj} {finding.verb} the risk of {finding.condition} by {finding.value}, according to a study by "
          "{study.subj} published on {study.date}."),
        U("people", "people months", "The trial followed {people.value} for {months.value}."),
        U("lead_researcher", "lead", "The research was led by Dr. {lead.subj} of {lead.obj}."),
        U("funding", "funding", "The work was funded by a {funding.value} grant from the {funding.subj}."),
    ),
)


# --- funding rounds ------------------------------------------------------------

def _make_funding(r: random.Random) -> dict[str, DraftFact]:
    cast, v = Cast(r), Values(r)
    startup, investor, investor2, founder, city = (cast.take(p) for p in ("company", "firm", "firm", "person", "city"))
    y = r.randint(2016, 2030)
    amount = v.millions(5, 400)
    return {
        "round": DraftFact(startup, value=amount, date=v.date(y), pred="raise"),
        "investor": DraftFact(investor, obj=startup),
        "investor2": DraftFact(investor2, obj=startup),
        "valuation": DraftFact(startup, value=v.near(amount, 5, 12)),
        "prev": DraftFact(startup, value=v.near(amount, 0.15, 0.6), date=v.year(y - 3, y - 1)),
        "hires": DraftFact(startup, value=v.count(20, 500, "engineers")),
        "founder": DraftFact(founder, obj=startup, date=v.year(2005, y - 2)),
        "customers": DraftFact(startup, value=v.count(200, 90000, "customers")),
        "hq": DraftFact(startup, obj=city),
    }


FUNDING = Family(
    "funding", _make_funding,
    cues={
        "round": C("raised|secured|raise|secure"),
        "investor": C("led"),
        "investor2": C("took part|taking part"),
        "valuation": C("values|valued"),
        "prev": C("previous round"),
        "hires": C("hire"),
        "founder": C("founded"),
        "customers": C("customers"),
        "hq": C("based|headquartered"),
    },
    lead=(
        S("round", "{round.subj}[hq:, a start-up based in {hq.obj},] {round.verb} {round.value} in new funding on "
                   "{round.date}.",
          "On {round.date}, {round.subj} {round.verb} {round.value} in new funding[investor: in a round led by "
          "{investor.subj}]."),
    ),
    body=(
        S("investor", "The round was led by {investor.subj}[investor2:, with {investor2.subj} also taking part].",
          "{investor.subj} led the round."),
        S("investor2", "{investor2.subj} also took part in the round."),
        S("valuation", "The deal values {valuation.subj} at {valuation.value}.",
          "{valuation.subj} is now valued at {valuation.value}."),
        S("prev", "{prev.subj} had raised {prev.value} in its previous round in {prev.date}.",
          "In its previous round, in {prev.date}, {prev.subj} raised {prev.value}.", distractor=True),
        S("hires", "{hires.subj} plans to hire {hires.value} over the next year.",
          "The money will help {hires.subj} hire {hires.value}."),
        S("founder", "{founder.subj} founded {founder.obj} in {founder.date}.",
          "{founder.obj} was founded in {founder.date} by {founder.subj}."),
        S("customers", "{customers.subj} says it has {customers.value}.",
          "The company now has {customers.value}, according to {customers.subj}."),
    ),
    units=(
        U("lead", "round", "{round.subj} {round.verb} {round.value} in new funding on {round.date}.",
          "On {round.date}, {round.subj} {round.verb} {round.value} in new funding."),
        U("investor", "investor", "The round was led by {investor.subj}."),
        U("valuation", "valuation", "The deal values {valuation.subj} at {valuation.value}."),
        U("hires", "hires", "{hires.subj} plans to hire {hires.value}."),
        U("founder", "founder", "{founder.subj} founded {founder.obj} in {founder.date}."),
    ),
)


# --- city councils ---------------------------------------------------------------

_PROJECTS = ["bridge", "light rail line", "water treatment plant", "sports arena", "hospital wing", "ferry terminal",
             "library", "flood barrier", "bus depot", "concert hall"]


def _make_council(r: random.Random) -> dict[str, DraftFact]:
    cast, v = Cast(r), Values(r)
    council, mayor, builder = cast.take("council"), cast.take("person"), cast.take("company")
    project = r.choice(_PROJECTS)
    y = r.randint(2016, 2028)
    budget = v.big_money(0.2, 6) if r.random() < 0.4 else v.millions(20, 900)
    yes = r.randint(5, 11)
    return {
        "vote": DraftFact(council, value=budget, date=v.date(y), pred="approve" if r.random() < 0.8 else "reject",
                   extra={"project": project}),
        "tally": DraftFact(council, value=score(yes, r.randint(1, yes - 1))),
        "done": DraftFact(council, date=v.year(y + 2, y + 6), extra={"project": project}),
        "jobs": DraftFact(council, value=v.count(100, 5000, "jobs")),
        "mayor": DraftFact(mayor, obj=council),
        "prior": DraftFact(council, value=v.near(budget, 0.4, 0.9), date=v.year(y - 12, y - 2)),
        "builder": DraftFact(builder, extra={"project": project}),
        "serve": DraftFact(council, value=v.count(5000, 400000, "residents", step=100), extra={"project": project}),
    }


COUNCIL = Family(
    "council", _make_council,
    cues={
        "vote": C("approved|backed|rejected|voted down|approve|back|reject|vote down"),
        "tally": C("measure"),
        "done": C("completed|finished"),
        "jobs": C("jobs"),
        "mayor": C("mayor"),
        "prior": C("similar plan"),
        "builder": C("contract"),
        "serve": C("serve"),
    },
    lead=(
        S("vote", "{vote.subj} {vote.verb} a {vote.value} plan to build a new {vote.project} on {vote.date}.",
          "On {vote.date}, {vote.subj} {vote.verb} plans for a new {vote.project} costing {vote.value}."),
    ),
    body=(
        S("tally", "Members of {tally.subj} voted {tally.value} on the measure.",
          "The vote on the measure in {tally.subj} was {tally.value}."),
        S("done", "The {done.project} is expected to be completed in {done.date}.",
          "Work on the {done.project} should be finished by {done.date}."),
        S("jobs", "The project is expected to create {jobs.value}.",
          "Building it will create {jobs.value}, according to {jobs.subj}."),
        S("mayor", "Mayor {mayor.subj} called the decision a turning point for the city.",
          "\"This is a turning point for the city,\" said Mayor {mayor.subj}."),
        S("prior", "A similar plan costing {prior.value} was shelved by {prior.subj} in {prior.date}.",
          "In {prior.date}, a similar plan costing {prior.value} was shelved.", distractor=True),
        S("builder", "{builder.subj} won the contract to build the {builder.project}.",
          "The contract to build the {builder.project} went to {builder.subj}."),
        S("serve", "The {serve.project} will serve about {serve.value}.",
          "Officials say the {serve.project} will serve {serve.value}."),
    ),
    units=(
        U("lead", "vote", "{vote.subj} {vote.verb} a {vote.value} plan to build a new {vote.project} on {vote.date}.",
          "On {vote.date}, {vote.subj} {vote.verb} a {vote.value} plan for a new {vote.project}."),
        U("tally", "tally", "Members of {tally.subj} voted {tally.value} on the measure."),
        U("done", "done", "The {done.project} is expected to be completed in {done.date}."),
        U("jobs", "jobs", "The project is expected to create {jobs.value}."),
        U("builder", "builder", "{builder.subj} won the contract to build the {builder.project}."),
    ),
)

FAMILIES: dict[str, Family] = {f.name: f for f in (EARNINGS, ACQUISITION, ELECTION, SPORTS, COURT, STORM, LAUNCH,
                                                   RESEARCH, FUNDING, COUNCIL)}

# Context sentences: no entity, number or date, each identified by one phrase. They
# lengthen articles (up to 14 sentences) and give summaries something to ignore.
CONTEXT: dict[str, tuple[tuple[str, str], ...]] = {
    "earnings": (("before markets opened", "The figures were released before markets opened."),
                 ("raw materials", "Higher costs of raw materials weighed on margins."),
                 ("new markets", "The company has been expanding into new markets to rely less on a few large "
                                 "customers.")),
    "acquisition": (("investment banks", "Both companies were advised by several investment banks."),
                    ("integration", "Integration of the two businesses is expected to take some time."),
                    ("consolidation", "The industry has seen a wave of consolidation in recent years.")),
    "election": (("campaign focused", "The campaign focused on housing, transport and public safety."),
                 ("polls had suggested", "Polls had suggested a much closer contest."),
                 ("concession speech", "The defeated candidate made a concession speech late in the evening.")),
    "sports": (("second half", "Both sides created chances in a lively second half."),
               ("best defences", "The game had been billed as a test of the league's two best defences."),
               ("final whistle", "Fans stayed long after the final whistle.")),
    "court": (("closely watched", "The case had been closely watched by the industry."),
              ("hearing lasted", "The hearing lasted three weeks."),
              ("legal experts", "Legal experts said the decision could shape similar disputes.")),
    "storm": (("schools and offices", "Schools and offices across the area were closed."),
              ("shelters", "Emergency shelters were opened in sports halls and churches."),
              ("forecasters", "Forecasters warned of more heavy rain in the coming days.")),
    "launch": (("improved camera", "The device has a larger screen and an improved camera."),
               ("early reviewers", "Early reviewers praised its design."),
               ("supply chain", "The company said its supply chain was ready for strong demand.")),
    "research": (("placebo", "Half of the volunteers received a placebo."),
                 ("larger trials", "The authors said larger trials were needed."),
                 ("mechanism", "The mechanism behind the effect remains unclear.")),
    "funding": (("helps shops", "The start-up sells software that helps shops manage stock."),
                ("poured money", "Investors have poured money into the sector this year."),
                ("profitable", "The company hopes to become profitable within three years.")),
    "council": (("public consultation", "A public consultation drew hundreds of comments."),
                ("congestion", "Residents have long complained about congestion in the area."),
                ("opponents", "Opponents argued that the money should be spent on schools.")),
}


# The long task's padding: lines any news story may carry, with no entity, number or date
# (context sentences for every family, after its own), each identified by one phrase.
GENERIC: tuple[tuple[str, str], ...] = (
    ("spokesperson said", "A spokesperson said more information would be shared later."),
    ("statement released", "The announcement was made in a statement released late in the day."),
    ("familiar with the matter", "People familiar with the matter said more news could follow."),
    ("first reported", "Local media first reported the news earlier in the week."),
    ("declined to give", "Officials declined to give further details about the timing."),
    ("coming weeks", "More details are expected to be published in the coming weeks."),
    ("mixed reaction", "The news drew a mixed reaction from observers, some of whom had expected less."),
    ("wider community", "It comes at a difficult time for the wider community, with costs still rising."),
    ("unanswered", "Critics said several important questions were still unanswered."),
    ("long overdue", "Supporters welcomed the move as long overdue and said it should have come sooner."),
    ("broader trend", "Observers see it as part of a broader trend across the region."),
    ("shared on social media", "The news was widely shared on social media within hours."),
    ("took questions", "At a briefing, officials took questions from reporters for almost an hour."),
    ("most closely watched", "It was one of the most closely watched stories of the week."),
    ("under way", "The next steps will depend on several reviews that are still under way."),
    ("businesses alike", "The outcome was closely followed by residents and businesses alike."),
    ("too early", "Some commentators cautioned that it was too early to judge the full impact."),
    ("in recent months", "Similar questions have been raised elsewhere in recent months."),
)


# ===========================================================================
# 4. The news world: rendering and generation
# ===========================================================================

_SLOT = re.compile(r"\{(\w+)\.(\w+)\}")
_OPTIONAL = re.compile(r"\[(\w+):([^\]]*)\]")
ENTITY_ATTRS = ("subj", "obj", "other")


@dataclass(frozen=True)
class Slot:
    role: str
    attr: str  # subj | obj | other | value | date | verb | an extra
    start: int
    end: int


def slot_text(f: DraftFact, attr: str, verb_text: str | None = None) -> str:
    if attr in ENTITY_ATTRS:
        ent = getattr(f, attr)
        if ent is None:
            raise KeyError(f"template uses {attr} of a fact that has none")
        return ent.name
    if attr == "value":
        return f.value.text
    if attr == "date":
        return f.date.text
    if attr == "verb":
        return verb_text
    return f.extra[attr]


def render(template: str, facts: dict[str, DraftFact], verbs: dict[str, str],
           include: Callable[[str], bool] = lambda role: False,
           override: dict[tuple[str, str], str] | None = None) -> tuple[str, list[Slot], list[str]]:
    """Fill a template: (text, slots with their character spans, roles of the optional clauses kept).

    `verbs` maps role -> the verb phrase to write; `override` replaces a slot's
    text (the drafter's errors), so the drafter knows exactly where it erred.
    """
    kept: list[str] = []

    def optional(m: re.Match) -> str:
        role = m.group(1)
        if role in facts and include(role):
            kept.append(role)
            return m.group(2)
        return ""

    t = _OPTIONAL.sub(optional, template)
    out, slots, pos, n = [], [], 0, 0
    for m in _SLOT.finditer(t):
        lit = t[pos:m.start()]
        out.append(lit)
        n += len(lit)
        role, attr = m.group(1), m.group(2)
        text = (override or {}).get((role, attr))
        if text is None:
            text = slot_text(facts[role], attr, verbs.get(role))
        slots.append(Slot(role, attr, n, n + len(text)))
        out.append(text)
        n += len(text)
        pos = m.end()
    out.append(t[pos:])
    return "".join(out), slots, kept


def choose_verbs(facts: dict[str, DraftFact], rng: random.Random) -> dict[str, str]:
    return {role: verb(f.pred, f.polarity, rng) for role, f in facts.items() if f.pred}


def _event_of(seed: int, i: int, retell_rate: float) -> int:
    """The event article i reports: its own, or (sometimes) an earlier article's, retold."""
    while i > 0:
        r = seeded_rng(seed, "retell", i)
        if r.random() >= retell_rate:
            break
        i = r.randrange(i)
    return i


TASKS = ("short", "long")  # the world's two tasks: `world_document`'s `task`

# The long task: news-length articles (GENERIC lines pad them to LONG_WORDS words), every
# key fact in a sentence that also carries another (a distractor where the family has one),
# and a reference that fuses 3-5 key facts into at most SUMMARY_WORDS words. No set of
# whole article sentences within that budget states the key facts.
LONG_WORDS = (300, 420)
SUMMARY_WORDS = 45
KEY_FACTS = (3, 5)
# Its padding lines recur across articles: different events share up to about 0.29 of their
# leak-guard features (same family), retold ones 0.47 or more, so `data.py split` runs at this.
LONG_SPLIT_THRESHOLD = 0.38
_JOINS = ("while", "and", "as")
# Words that keep their capital when a sentence is joined after another: titles and months.
_KEEP_CAPITAL = frozenset(MONTHS) | {"Dr.", "Mayor", "I"}


def _join(a: str, b: str, how: str, names: Iterable[str]) -> str:
    """Two sentences as one: `a`, then `how`, then `b`, its first word lower-cased unless
    it opens one of the article's `names` (or is a title or a month)."""
    first = b.split(" ", 1)[0]
    if first not in _KEEP_CAPITAL and not any(n.split(" ", 1)[0] == first for n in names):
        b = first.lower() + b[len(first):]
    return f"{a.rstrip('.')}, {how} {b}"


def world_document(seed: int, i: int, retell_rate: float = 0.08, task: str = "short") -> Document:
    """Article i of the world `seed`: depends only on (seed, i), never on how many are generated.

    `task` "short": 6-14 sentences (about 100 words), a reference of the lead unit plus
    one to three others. "long": the long task above (about 300-420 words)."""
    if task not in TASKS:
        raise ValueError(f"unknown news world task {task!r} (tasks: {', '.join(TASKS)})")
    event = _event_of(seed, i, retell_rate)
    er = seeded_rng(seed, "event", event)
    family = FAMILIES[er.choice(sorted(FAMILIES))]
    facts = family.make(er)
    context = context_of(family.name, task)
    for k, (_, sentence) in enumerate(context):
        facts[f"ctx{k}"] = DraftFact(None, extra={"text": sentence})

    if task == "short":
        sr = seeded_rng(seed, "surface", i)
        # The summary: the lead unit plus one to three others; their roles are the key facts.
        units = [family.units[0]] + sr.sample(family.units[1:], min(len(family.units) - 1, sr.choice([1, 2, 2, 3])))
    else:
        sr = seeded_rng(seed, "surface", task, i)
        summary_verbs = choose_verbs(facts, sr)
        units = _budget_units(family, facts, summary_verbs, sr)
    key_roles = {role for u in units for role in u.roles}
    # The article: the lead, the sentences that state key facts, then distractors
    # first (careless copying should have something to err on) and the rest.
    lead = family.lead[0]
    own = len(CONTEXT[family.name])  # the family's context lines; the long task's GENERIC ones follow
    body = list(family.body) + [Sent((f"ctx{k}",), ("{ctx%d.text}" % k,)) for k in range(own)]
    need = [s for s in body if set(s.roles) & key_roles]
    rest = [s for s in body if s not in need]
    sr.shuffle(rest)
    rest.sort(key=lambda s: not s.distractor)
    if task == "short":
        n_sent = sr.randint(6, 14)
        chosen = need + rest[:max(0, n_sent - 1 - len(need))]
        sr.shuffle(chosen)
        groups = [[spec] for spec in [lead] + chosen]
    else:
        generic = [Sent((f"ctx{k}",), ("{ctx%d.text}" % k,)) for k in range(own, len(context))]
        groups = _long_groups(lead, need, rest, sr.sample(generic, len(generic)), sr)

    verbs = choose_verbs(facts, sr)
    names = {getattr(f, a).name for f in facts.values() for a in ENTITY_ATTRS if getattr(f, a) is not None}
    sentences, stated = [], {}
    for idx, group in enumerate(groups):
        parts = []
        for spec in group:
            text, _, kept = render(sr.choice(spec.templates), facts, verbs,
                                   include=lambda role: task == "long" or sr.random() < 0.5)
            parts.append(text)
            for role in list(spec.roles) + kept:
                stated.setdefault(role, idx)
        sentences.append(parts[0] if len(parts) == 1 else _join(parts[0], parts[1], sr.choice(_JOINS), names))
    if task == "long":
        sentences = _pad(sentences, [f"ctx{k}" for k in range(own, len(context))], facts, stated, sr)

    order = sorted(stated, key=lambda role: (stated[role], list(facts).index(role)))
    table = [fact_to_dict(f"f{k}", family.name, role, facts[role], stated[role], role in key_roles)
             for k, role in enumerate(order)]
    entities: dict[str, str] = {}
    for role in order:
        for attr in ENTITY_ATTRS:
            ent = getattr(facts[role], attr)
            if ent is not None:
                entities.setdefault(ent.name, ent.type)
    if task == "short":
        summary_verbs = choose_verbs(facts, sr)
    summary = " ".join(render(sr.choice(u.templates), facts, summary_verbs)[0] for u in units)
    meta = {"world": WORLD_VERSION, "event": f"{seed}-{event}", "units": [u.name for u in units]}
    if task != "short":
        meta["task"] = task
    return Document(id=f"nw-{seed}-{i:06d}" + ("" if task == "short" else f"-{task}"), text=" ".join(sentences),
                    summary=summary, source="newsworld", bucket=family.name, facts=table, entities=entities,
                    meta=meta)


def context_of(family: str, task: str = "short") -> tuple[tuple[str, str], ...]:
    """A family's context sentences (cue phrase, sentence); the long task adds the GENERIC ones."""
    return CONTEXT[family] + (GENERIC if task == "long" else ())


def task_of(doc: Document) -> str:
    return (doc.meta or {}).get("task", "short")


def _budget_units(family: Family, facts: dict[str, DraftFact], verbs: dict[str, str], sr: random.Random) -> list:
    """The long task's reference: the lead unit, then other units in a random order while the
    key facts stay within KEY_FACTS and the words within SUMMARY_WORDS (rendered as written)."""
    units = [family.units[0]]
    words = max(_n_words(render(t, facts, verbs)[0]) for t in family.units[0].templates)
    for u in sr.sample(family.units[1:], len(family.units) - 1):
        roles = sum(len(x.roles) for x in units)
        if roles >= KEY_FACTS[1]:
            break
        w = max(_n_words(render(t, facts, verbs)[0]) for t in u.templates)
        if words + w <= SUMMARY_WORDS:
            units.append(u)
            words += w
    return units


def _n_words(text: str) -> int:
    """Words as the reward's length rule counts them (textsplit.words: "4-0" is two)."""
    return len(textsplit.words(text))


def _long_groups(lead: Sent, need: list[Sent], rest: list[Sent], generic: list[Sent], sr: random.Random
                 ) -> list[list[Sent]]:
    """The long task's sentence plan: the lead, then every body sentence. The lead and each
    key-fact sentence are joined with another: a distractor while one is left, then the
    family's other sentences, then GENERIC lines. So no two whole sentences that state key
    facts fit in the summary's budget together."""
    partners = [s for s in rest if s.distractor] + [s for s in rest if not s.distractor] + generic
    groups = [[spec, partners.pop(0)] for spec in need]
    groups += [[s] for s in partners if s not in generic]
    sr.shuffle(groups)
    return [[lead, partners.pop()]] + groups


def _pad(sentences: list[str], generic: list[str], facts: dict[str, DraftFact], stated: dict[str, int],
         sr: random.Random) -> list[str]:
    """The long task's sentences padded to a drawn length with the GENERIC context lines
    (their roles: `generic`) that are not in yet, each inserted at a random place after the
    lead (fact indices follow)."""
    target = sr.randint(*LONG_WORDS)
    spare = [role for role in generic if role not in stated]
    sr.shuffle(spare)
    out = list(sentences)
    roles_at = [[r for r, j in stated.items() if j == idx] for idx in range(len(out))]
    while spare and sum(_n_words(s) for s in out) < target:
        role = spare.pop()
        at = sr.randint(1, len(out))
        out.insert(at, facts[role].extra["text"])
        roles_at.insert(at, [role])
    for idx, roles in enumerate(roles_at):
        for role in roles:
            stated[role] = idx
    return out


def documents(n: int, seed: int = 0, start: int = 0, retell_rate: float = 0.08, task: str = "short"
              ) -> Iterator[Document]:
    """Articles start .. start+n-1 of the world `seed` (a stream; byte-identical across runs)."""
    for i in range(start, start + n):
        yield world_document(seed, i, retell_rate, task)


# --- fact tables -----------------------------------------------------------------

def fact_to_dict(fid: str, family: str, role: str, f: DraftFact, sentence: int, key: bool) -> dict:
    return {
        "id": fid,
        "kind": f"{family}.{role}",
        "subject": f.subj.name if f.subj else None,
        "object": f.obj.name if f.obj else None,
        "other": f.other.name if f.other else None,
        "value": f.value.text if f.value else None,
        "unit": f.value.unit if f.value else None,
        "amount": f.value.amount if f.value else None,
        "date": f.date.text if f.date else None,
        "predicate": f.pred,
        "polarity": f.polarity,
        "sentence": sentence,  # index of the (first) article sentence that states it
        "key": key,  # stated by the reference summary
        "extra": f.extra,
    }


def fact_from_dict(d: dict, entities: dict[str, str]) -> DraftFact:
    def ent(name):
        return Ent(name, entities.get(name, "unknown")) if name else None

    value = Qty(d["value"], d["amount"], d["unit"]) if d.get("value") is not None else None
    date = parse_when(d["date"]) if d.get("date") else None
    return DraftFact(ent(d.get("subject")), ent(d.get("object")), ent(d.get("other")), value, date,
              d.get("predicate"), d.get("polarity", True), dict(d.get("extra") or {}))


def doc_facts(doc: Document) -> dict[str, tuple[dict, DraftFact]]:
    """role -> (fact dict, fact) for a news world document."""
    if not doc.facts:
        raise DataError(f"document {doc.id!r} has no fact table (only news world documents do)")
    return {d["kind"].split(".", 1)[1]: (d, fact_from_dict(d, doc.entities)) for d in doc.facts}


def parse_when(text: str) -> When:
    m = re.fullmatch(rf"({'|'.join(MONTHS)}) (\d{{1,2}}), (\d{{4}})", text)
    if m:
        return When(text, int(m.group(3)), MONTHS.index(m.group(1)) + 1, int(m.group(2)))
    m = re.fullmatch(rf"({'|'.join(MONTHS)}) (\d{{4}})", text)
    if m:
        return When(text, int(m.group(2)), MONTHS.index(m.group(1)) + 1)
    if re.fullmatch(r"\d{4}", text):
        return When(text, int(text))
    raise ValueError(f"not a date: {text!r}")


def fresh_documents(n: int | Iterable[int], seed: int, guard: "data.LeakGuard | None" = None, task: str = "short"
                    ) -> tuple[list[Document], list[str]]:
    """(documents, ids skipped): articles 0..n-1 (or the indices `n`) of the world
    `seed`, less those `guard` finds in a held-out cluster."""
    kept, skipped = [], []
    for i in (range(n) if isinstance(n, int) else n):
        doc = world_document(seed, i, task=task)
        if guard is not None and guard.match(doc) is not None:
            skipped.append(doc.id)
        else:
            kept.append(doc)
    return kept, skipped


