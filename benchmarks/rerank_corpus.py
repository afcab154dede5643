"""The rerank benchmark's chat: one query and chat-length candidates a search would retrieve."""

QUERY = (
    "does anyone remember what time the guild raid got moved to on saturday, "
    "and who is leading it?"
)
# Chat messages of 21 to 60 Qwen tokens (mean 33), as a search would retrieve them.
CANDIDATES = (
    (
        "raid got moved to 9pm server time because half the guild has work until 8, check the "
        "pinned message in #events before you ask again please"
    ),
    (
        "lol yeah I saw that, honestly 9 is way better for me anyway since I get home from work"
        " around half past eight"
    ),
    (
        "I think Mara is leading it this week, Dan did it last time and he said he really needs"
        " a break from calling the fights"
    ),
    (
        "can someone explain how the new loot council rules work? I missed the meeting on "
        "tuesday and nobody wrote any notes in the officer channel, and now I'm seeing people "
        "argue about who gets the trinket from the third boss and I honestly have no idea what "
        "the priority list is supposed to be"
    ),
    (
        "saturday is fine for me but I can only stay until 11, my kid has a swim meet early on "
        "sunday morning and I'm the one driving"
    ),
    (
        "the deploy broke again, the migration script wasn't applied on the staging box so the "
        "bot is down until someone with ssh access fixes it"
    ),
    (
        "reminder: bring snacks to the meetup next week, the venue doesn't have a kitchen this "
        "time and the pizza place nearby closes at ten"
    ),
    (
        "who's leading on saturday? last I heard it was Mara but that was before the whole "
        "schedule change, so maybe it's Dan again"
    ),
    (
        "9 works for me, I'll bring the usual consumables and I can tank if we're short on "
        "tanks again like last week"
    ),
    (
        "ok so the raid is at 9 now? I'm going to be late then, tell them to start without me "
        "and I'll join for the second boss at the latest"
    ),
    (
        "has anyone tried the new patch? my fps dropped from 120 to about 45 in the capital "
        "city and I have no idea why, drivers are up to date, I already deleted the cache "
        "folder and turned off the new shadow setting, nothing helps"
    ),
    (
        "Mara here: raid moved to 9pm saturday, I'm leading, bring flasks and food buffs, we're"
        " doing the first four bosses and then calling it. If we one-shot the first three we "
        "might try the fifth for progress, so plan for a late night just in case"
    ),
    (
        "what was the name of that lentil recipe someone posted last month? the one with lemon,"
        " cumin and a ton of garlic, I want to make it tonight"
    ),
    (
        "honestly we should move the raid to sunday permanently, saturdays are always a mess "
        "with people dropping out at the last minute"
    ),
    (
        "gg everyone, great run tonight, we cleared it in under two hours which is a new guild "
        "record, thanks Mara for the calls"
    ),
    (
        "I'll be there at 9 but my internet has been flaky all week so no promises, if I "
        "disconnect just replace me with a bench player. The ISP says a technician comes on "
        "monday, so after that it should finally be stable again"
    ),
    (
        "can an officer update the calendar? it still says 8pm for saturday and people keep "
        "asking about it in general chat every hour"
    ),
    (
        "the calendar bot is broken again, it posts events in UTC and everyone reads them as "
        "local time, which is why nobody knows when anything is. I opened an issue on the repo "
        "two weeks ago with logs and screenshots but nobody has looked at it yet"
    ),
    (
        "time zones are the worst, half of us are in the EU and half in US east, so literally "
        "any raid time is bad for somebody"
    ),
    (
        "yo who has the spreadsheet with the roster? I need to check if we have enough healers "
        "for saturday before I confirm my alt, otherwise I'll bring my main as dps, she has "
        "better gear anyway but I wanted to level the healer"
    ),
    (
        "healers: we have three confirmed, tanks two, dps is full, so we're good for saturday "
        "as long as nobody cancels last minute"
    ),
    (
        "btw the raid leader this week asked everyone to read the boss guide before we start, "
        "especially the part about the second phase"
    ),
    (
        "did anyone see the trailer for the expansion? looks like they're finally adding player"
        " housing and a new flying mount system"
    ),
    (
        "moving it to 9 was Dan's idea, he posted about it in officer chat on wednesday and "
        "nobody objected so it just happened"
    ),
    (
        "no idea sorry, I haven't been online since the patch dropped, my laptop can't even "
        "launch the game anymore"
    ),
    (
        "I'm out this weekend, family stuff, have fun everyone and don't wipe too many times on"
        " the last boss without me"
    ),
    (
        "quick question: is the raid 9pm EU or 9pm US east? the pinned message doesn't say and "
        "it makes a six hour difference for me, because if it's EU time I'd have to log in "
        "during my lunch break and that is not happening on a work day"
    ),
    (
        "pinned it: saturday raid 9pm server time (EU), Mara leading, sign up in the "
        "spreadsheet by friday evening so we can plan groups"
    ),
    (
        "anyone want to run dungeons tonight? need two more people, ideally a healer, we're "
        "doing the new ones for the weekly cache"
    ),
    (
        "the bot keeps answering in the wrong channel, can someone with admin rights check its "
        "permissions and the channel overrides"
    ),
)
