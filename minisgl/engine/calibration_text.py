"""A fixed English text (written for this project) for FP8 KV-scale calibration and the
accuracy benchmark: essays, a story, instructions, dialogue and a little code: 2,738 tokens
for the SmolLM2 tokenizer."""

TEXT = """\
The Mill on the River

For most of its history the village had one reason to exist, and that reason was the river. It
came down from the hills in a hurry, cold and brown in spring, clear and slow by the end of
summer, and at the narrow place below the old bridge it dropped the height of two men over a
shelf of grey stone. Someone, long before anyone now living could remember, had noticed that
the drop could turn a wheel. The first mill was probably a small affair of timber and rope,
grinding the grain of a few families. The one that stands there today was built of stone in
the year the church got its second bell, and it ground flour for three valleys until the
railway came.

A water mill is a simple machine in principle and a difficult one in practice. The water is
led away from the river along a channel called the leat, which runs almost level while the
river falls, so that by the time the two meet again at the mill there is a useful difference in
height between them. The water is let onto the wheel through a gate, and the miller controls
the speed of the whole building by raising or lowering that gate by a few inches. Too little
water and the stones turn slowly and the flour comes out coarse. Too much and the wheel races,
the stones heat, and the flour tastes burnt. A good miller listened to his mill the way a
doctor listens to a patient, and he could tell from the rhythm of the gears in the next room
whether the day's work was going well.

The millstones themselves were the most valuable thing in the building. The best came from
quarries far away, and they were carried to the village on carts with wheels as wide as a
man's hand, to keep them from sinking into the mud of the roads. Each stone had a pattern of
grooves cut into its face, and the grooves had to be recut every few weeks with a small steel
pick, a job called dressing the stone. It was slow, patient work. The men who did it had tiny
blue marks on the backs of their hands where splinters of steel had entered the skin and never
come out, and in the old days a traveling miller looking for work would be asked to show his
hands, so that his employer could see how much experience he had.

When the railway arrived, flour began to come from great steam mills in the cities, where it was
ground between steel rollers instead of stones. It was whiter and finer and, above all, cheaper.
The village mill kept going for another thirty years, grinding feed for animals and a little
flour for the people who preferred the old taste, and then one winter the wheel froze and nobody
bothered to free it. The building stood empty for a generation. Today it belongs to a trust that
restored the wheel and the stones, and on the first Sunday of every month the gate is opened and
the whole machine groans back into life, to the delight of children who have never seen flour
that did not come in a paper bag.

On Measuring Things

It is easy to forget that units of measurement were once local inventions, as particular to a
place as its dialect or its recipes. A foot was, at first, roughly the length of a foot, and a
market town might keep an iron bar on the wall of its hall to settle arguments about exactly
whose foot was meant. A bushel of grain in one county was not the same as a bushel in the next,
and traders who moved between them had to keep tables of conversions in their heads. The
confusion was not merely an inconvenience. It made fraud easy and honest trade hard, and it
meant that a farmer could not easily compare the price he was offered at home with the price he
might get in a town a day's walk away.

The metric system was an attempt to replace all of this with units derived from nature rather
than from custom. The meter was defined as a fraction of the distance from the pole to the
equator, and the surveyors who measured that distance spent years dragging instruments across
mountains and through wars to get the number right. Their result was slightly wrong, as it
happens, but that hardly mattered: what mattered was that there was now one meter, kept in one
place, against which every other could be checked. Over the following two centuries the
definitions moved further from physical objects. Today the meter is defined by the speed of
light and the second, and the second by the vibrations of a particular kind of atom. Anyone
with the right equipment, anywhere in the world, can reproduce them without borrowing anything
from anyone.

There is a lesson in this that reaches beyond science. A standard is useful not because it is
perfect but because it is shared. Two people who agree on a unit can disagree productively
about everything else: about what something costs, how far it is, whether it is worth the
trouble. Two people who do not agree on the unit will spend their time arguing about words.

A Short Story: The Lighthouse Keeper's Visitor

The storm had been blowing for three days when the knock came at the door. Mara had not heard a
boat, and for a moment she thought the wind had thrown something against the wood. Then it came
again, three careful knocks, and she took the lamp and went down the spiral stairs.

The man on the step was soaked through and shivering, with a canvas bag held against his chest
as though it were a child. He said his name was Tomas and that his boat had lost its rudder off
the point. He had rowed the last half mile in the small tender, and the tender was now somewhere
on the rocks below the tower, probably in pieces.

She gave him dry clothes, which were too big for him, and soup, which he ate too fast. He did not
let go of the bag. When she asked him what was in it he hesitated, and then he opened it and
showed her: a clock, an old ship's chronometer in a brass case, its face yellowed with age.

"It belonged to my grandfather," he said. "He kept it running for forty years. My father kept it
running after him. I was taking it to a man in the city who repairs them, because it has started
to lose a minute every day, and I could not bear to let it stop."

Mara looked at the clock for a long time. On the wall behind her hung the logbook of the
lighthouse, with every night's weather written in the same careful columns by every keeper
since the tower was built. She understood, she thought, what it meant to keep something going
simply because someone before you had done the same.

"Leave it here tonight," she said. "The wind will drop by morning, and the supply boat comes on
Thursday. I will make sure it gets to the city."

He slept in the chair by the stove. In the morning the sea was flat and silver, and the clock,
which she had wound and set by the lighthouse's own instrument, had lost exactly one minute.

How to Bake a Simple Loaf of Bread

You will need five hundred grams of strong white flour, ten grams of salt, seven grams of dried
yeast and about three hundred and twenty milliliters of warm water. Mix the flour, salt and yeast
in a large bowl, keeping the salt and the yeast apart at first, because salt in direct contact
slows the yeast down. Pour in most of the water and stir until a rough dough forms, adding the
rest of the water a little at a time if the dough feels dry.

Turn the dough out onto a lightly floured surface and knead it for about ten minutes. At first it
will be sticky and uneven; after a while it will become smooth and stretchy, and when you press a
finger into it the dent will slowly fill back in. Put the dough back into the bowl, cover it with
a damp cloth and leave it somewhere warm for an hour or so, until it has roughly doubled in size.

Knock the air out of the dough by pressing it down with your knuckles, shape it into a loaf and
place it in a greased tin. Cover it again and leave it for another thirty to forty minutes. Heat
the oven to two hundred and twenty degrees. When the loaf has risen above the edge of the tin,
bake it for thirty minutes, until it is golden brown and sounds hollow when you tap the bottom.
Let it cool on a rack before slicing, however tempting the smell.

A Conversation About Learning

"Why do you keep notes by hand," asked the student, "when you could simply type them?"

"Because writing by hand is slow," said the teacher, "and the slowness is the point. When I type,
I copy what I hear. When I write, I cannot keep up, so I have to decide what matters. That
decision is where the learning happens."

"But then you miss things."

"Of course. Everyone misses things. The question is whether you miss them because you were
thinking or because you were not. A perfect transcript of a lecture you did not understand is
worth less than three lines you did."

The student considered this. "So the notes are not really for reading later."

"They are for reading later too. But mostly they are a record of what you noticed. Look at your
notes from a year ago and you will see what you used to think was important. That is a kind of
map of your own mind, and it is more useful than you might expect."

Counting Words in a Few Lines of Code

Programs that process text often begin with the same small task: counting how many times each
word appears. In Python it can be written in a handful of lines.

    def count_words(text):
        counts = {}
        for word in text.lower().split():
            word = word.strip(".,;:!?\\"'()")
            if word:
                counts[word] = counts.get(word, 0) + 1
        return counts

    def most_common(counts, n=10):
        return sorted(counts.items(), key=lambda item: item[1], reverse=True)[:n]

The first function lowers the case of the whole text, splits it on whitespace and strips the
punctuation from both ends of each piece, so that "River," and "river" are counted together.
The second sorts the pairs of word and count by the count, largest first, and keeps the first
n. Run on this document, the most common words would be the small ones that hold sentences
together: the, and, of, a, to. Words like mill, light and bread would come much further down,
even though they are what the document is about. That pattern, in which a few words are very
common and most words are rare, appears in almost every language and every kind of writing,
and it is one of the reasons that simple counts are a poor guide to meaning.

Notes on the Seasons in the Valley

In January the valley is quiet. The fields lie under frost until late morning, and the only
sounds are the river and the occasional tractor carrying hay to the sheep on the higher ground.
The days are short enough that the school buses leave in the dark and come back in the dark,
and the lights of the farmhouses look very far apart.

By April everything has changed. The river is high with meltwater from the hills, the lambs are
out in the lower fields, and the hedges are white with blossom. Farmers work from first light
until the evening, and the roads are busy with machinery. It is the most hopeful time of the
year, and also the most anxious: a late frost can still ruin the fruit, and a wet week can delay
the planting until it is too late to catch the best of the summer.

Summer brings visitors. They walk the footpath along the leat, picnic by the old mill and buy
honey and eggs from the tables at the farm gates. The village shop stocks ice cream and sun
cream, and the pub puts tables out on the green. In the evenings the swallows fly low over the
water, and the light lasts until well after ten.

Autumn is the season of work again. The harvest comes in, the apples are picked and pressed,
and the wood is cut and stacked for the winter. The first storms strip the leaves from the
trees by the river, and one morning the fields are white again, and the year has come round."""
