//! The bodies of RULER's two aggregation tasks, as token ids that fill a budget exactly
//! or fall short of it by less than one item (the caller pads the rest, [`pad_token`]):
//! - common-words extraction ([`common_list`]): a numbered list ` 1. word 2. word …` in
//!   which a few common words occur `R` times each and many uncommon words `r` or `r − 1`
//!   times, `r ≤ R / 2`, shuffled;
//! - frequent-words extraction ([`frequent_text`]): coded words (random lowercase
//!   letters) with Zipf counts — the word of rank `k` occurs `⌊N / (k² ζ(2))⌋` times, the
//!   top rank being the noise word `...` — shuffled, `N` as large as the budget allows
//!   (and the noise word a few times more, to fill the rest).
//!
//! Every piece (` 12.`, ` word`) is encoded on its own and the ids concatenated, so a
//! body's length is the sum of its pieces' lengths and is known before it is built.

use crate::data::shuffle::SplitMix64;
use crate::eval::needle::encode;
use crate::Result;

/// The word pool of common-words extraction: our own list of English nouns, adjectives
/// and verbs, lowercase, none a substring of another (so recall cannot count one word
/// for another).
pub const WORDS: [&str; 311] = [
    "anchor", "apron", "acorn", "attic", "badger", "bagel", "bamboo", "banjo", "barrel", "basket", "beetle", "blanket", "blossom",
    "bottle", "boulder", "bracelet", "bridge", "bucket", "buffalo", "bundle", "butter", "button", "cabbage", "cabin", "cactus", "camel",
    "candle", "canoe", "carpet", "carrot", "castle", "cedar", "cellar", "chalk", "cherry", "chimney", "cinnamon", "circus", "cliff",
    "clover", "cobweb", "coconut", "coffee", "collar", "comet", "copper", "cottage", "cotton", "cradle", "crayon", "cricket", "crown",
    "cushion", "dagger", "daisy", "desert", "diamond", "dolphin", "donkey", "dragon", "drum", "eagle", "easel", "elbow", "engine",
    "feather", "fence", "fiddle", "finger", "flute", "forest", "fossil", "fountain", "fox", "garden", "garlic", "giraffe", "glove",
    "goblet", "gravel", "guitar", "hammer", "hamster", "harp", "hazel", "helmet", "honey", "hornet", "iceberg", "island", "ivory",
    "jacket", "jaguar", "jelly", "jewel", "jungle", "kayak", "kernel", "kitten", "ladder", "lemon", "leopard", "lettuce", "lizard",
    "lobster", "locket", "magnet", "mango", "maple", "marble", "meteor", "mirror", "mitten", "monkey", "mosquito", "muffin", "mustard",
    "napkin", "needle", "nectar", "nickel", "nutmeg", "oyster", "paddle", "palace", "panther", "parrot", "peanut", "pearl", "pelican",
    "pencil", "pepper", "piano", "pickle", "pillow", "pirate", "planet", "plum", "pocket", "pony", "potato", "pumpkin", "puppet", "puzzle",
    "quilt", "rabbit", "radish", "raisin", "raven", "rocket", "saddle", "salmon", "sandal", "satchel", "scarf", "seagull", "shovel",
    "silver", "skillet", "sled", "snail", "spider", "spoon", "squirrel", "statue", "stove", "sugar", "sunflower", "swan", "sweater",
    "tablet", "teapot", "thimble", "thunder", "tiger", "tomato", "torch", "tractor", "trumpet", "tulip", "turnip", "turtle", "umbrella",
    "valley", "velvet", "violin", "volcano", "waffle", "wagon", "walnut", "walrus", "whistle", "window", "wizard", "yarn", "zebra",
    "brave", "bright", "bumpy", "chilly", "clever", "cloudy", "crispy", "curly", "dizzy", "dusky", "fancy", "fluffy", "foggy", "fragile",
    "frosty", "fuzzy", "gloomy", "glossy", "golden", "grumpy", "hasty", "hungry", "jagged", "jumpy", "lazy", "lonely", "lucky", "merry",
    "muddy", "narrow", "nimble", "noisy", "polite", "proper", "quiet", "rapid", "rough", "rusty", "salty", "sandy", "shaggy", "shiny",
    "silent", "silky", "sleepy", "slippery", "smoky", "snowy", "soggy", "sour", "spicy", "steep", "sticky", "stormy", "sturdy", "sunny",
    "swift", "tender", "thirsty", "tidy", "timid", "tiny", "tricky", "ugly", "vivid", "wobbly", "wooden", "yellow", "zesty", "bake",
    "bounce", "carve", "chase", "climb", "crawl", "dance", "dig", "drift", "fetch", "float", "fold", "gallop", "gather", "giggle", "glide",
    "grumble", "hike", "hop", "hover", "juggle", "knit", "kneel", "mumble", "paint", "plant", "polish", "pounce", "scribble", "shiver",
    "sketch", "skip", "slurp", "sneeze", "snore", "sprint", "stir", "stumble", "swim", "wrestle", "twirl", "wander", "whisper", "wiggle",
    "yawn", "zoom",
];

/// The noise word of frequent-words extraction (the most frequent rank, not asked for).
pub const NOISE: &str = "...";

/// Letters of a coded word.
pub const CODED_LEN: usize = 6;

/// Words asked for in frequent-words extraction (RULER's three).
pub const FREQUENT: usize = 3;

/// A token that fills a gap: the first of a newline, a space and a full stop that the
/// tokenizer encodes alone as one token, else the last token of a full stop when it
/// decodes to ".". An error when there is none.
pub(crate) fn pad_token(tok: &tokenizers::Tokenizer) -> Result<u32> {
    for c in ["\n", " ", "."] {
        if let [id] = encode(tok, c)?[..] {
            return Ok(id);
        }
    }
    if let Some(&id) = encode(tok, ".")?.last() {
        if tok.decode(&[id], false).is_ok_and(|s| s == ".") {
            return Ok(id);
        }
    }
    Err(crate::Error::Setting(
        "the tokenizer has no single token for a newline, a space or a full stop, which the words tasks (cwe, fwe) fill with; \
         run the other tasks (--tasks single,multikey,multivalue,multiquery,vt)"
            .into(),
    ))
}

/// The ids of the list numbers ` 1.`, ` 2.`, …, encoded once each as they are needed.
struct Numbers<'a> {
    tok: &'a tokenizers::Tokenizer,
    ids: Vec<Vec<u32>>,
}

impl Numbers<'_> {
    /// The ids of ` {i}.` (`i ≥ 1`).
    fn get(&mut self, i: usize) -> Result<&[u32]> {
        while self.ids.len() < i {
            let n = self.ids.len() + 1;
            self.ids.push(encode(self.tok, &format!(" {n}."))?);
        }
        Ok(&self.ids[i - 1])
    }

    /// Tokens of the numbers `1..=m`.
    fn cost(&mut self, m: usize) -> Result<usize> {
        self.get(m.max(1))?;
        Ok(self.ids[..m].iter().map(Vec::len).sum())
    }
}

/// A common-words list: its ids and its shape.
#[derive(Debug, Clone, PartialEq)]
pub struct CommonList {
    pub ids: Vec<u32>,
    /// Occurrences of each common word.
    pub common_repeats: usize,
    /// Most occurrences of an uncommon word (each has this many or one fewer).
    pub uncommon_repeats: usize,
    /// Uncommon words in the list.
    pub uncommon_words: usize,
}

/// The common-words list of at most `budget` tokens: every word of `common` `R` times,
/// then the words of `uncommon` in turns, one occurrence each per turn, while items fit
/// (at most `R / 2` occurrences each), shuffled and numbered. The common words take about
/// 30 % of the items (`R ≥ 2`); the list falls short of the budget by less than one item.
/// `None` when fewer than `common.len()` uncommon words fit.
pub fn common_list(
    tok: &tokenizers::Tokenizer,
    common: &[&str],
    uncommon: &[&str],
    budget: usize,
    rng: &mut SplitMix64,
) -> Result<Option<CommonList>> {
    let word_ids = |ws: &[&str]| ws.iter().map(|w| encode(tok, &format!(" {w}"))).collect::<Result<Vec<_>>>();
    let (c_ids, u_ids) = (word_ids(common)?, word_ids(uncommon)?);
    let nc = common.len();
    let mut numbers = Numbers { tok, ids: Vec::new() };
    // Items that fit, estimated from the mean word and a number of about the right size.
    let mean_word = (c_ids.iter().chain(&u_ids).map(Vec::len).sum::<usize>() as f64 / (nc + uncommon.len()) as f64).max(1.0);
    let rough = (budget / (mean_word as usize + 2)).max(1);
    let est = budget as f64 / (mean_word + numbers.get(rough)?.len() as f64);
    let mut big_r = ((0.3 * est / nc as f64).round() as usize).max(2);
    let common_tokens: usize = c_ids.iter().map(Vec::len).sum();
    let mut cost = numbers.cost(nc * big_r)? + big_r * common_tokens;
    while cost > budget && big_r > 2 {
        big_r -= 1;
        cost = numbers.cost(nc * big_r)? + big_r * common_tokens;
    }
    if cost > budget {
        return Ok(None);
    }
    let mut items: Vec<usize> = (0..nc).flat_map(|w| std::iter::repeat_n(w, big_r)).collect();
    'turns: for _ in 0..(big_r / 2).max(1) {
        for (j, w) in u_ids.iter().enumerate() {
            let next = numbers.get(items.len() + 1)?.len() + w.len();
            if cost + next > budget {
                break 'turns;
            }
            cost += next;
            items.push(nc + j);
        }
    }
    let uncommon_items = items.len() - nc * big_r;
    let used = uncommon_items.min(uncommon.len());
    if used < nc {
        return Ok(None);
    }
    rng.shuffle(&mut items);
    let mut ids = Vec::with_capacity(budget);
    for (i, &w) in items.iter().enumerate() {
        ids.extend_from_slice(numbers.get(i + 1)?);
        ids.extend_from_slice(if w < nc { &c_ids[w] } else { &u_ids[w - nc] });
    }
    debug_assert_eq!(ids.len(), cost);
    let uncommon_repeats = uncommon_items.div_ceil(uncommon.len().max(1));
    Ok(Some(CommonList { ids, common_repeats: big_r, uncommon_repeats, uncommon_words: used }))
}

/// `size` distinct coded words of [`CODED_LEN`] random lowercase letters, the first
/// replaced by [`NOISE`]: the vocabulary of frequent-words extraction in rank order.
pub fn coded_vocab(rng: &mut SplitMix64, size: usize) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    let mut out = vec![NOISE.to_string()];
    while out.len() < size.max(1) {
        let w: String = (0..CODED_LEN).map(|_| char::from(b'a' + rng.below(26) as u8)).collect();
        if seen.insert(w.clone()) {
            out.push(w);
        }
    }
    out
}

/// Zipf counts (exponent 2) of `ranks` ranks for about `n` words: rank `k` (from 1)
/// occurs `⌊n / (k² ζ(2))⌋` times, ζ(2) = π²/6.
pub fn zipf_counts(n: usize, ranks: usize) -> Vec<usize> {
    let zeta2 = std::f64::consts::PI * std::f64::consts::PI / 6.0;
    (1..=ranks).map(|k| (n as f64 / ((k * k) as f64 * zeta2)).floor() as usize).collect()
}

/// The frequent-words text of at most `budget` tokens over `vocab` (rank order, first the
/// noise word): the largest `n` whose [`zipf_counts`] fit, each word that many times, the
/// noise word more often to fill what is left, shuffled. `None` when the budget leaves the ranks 2 to 4 (the words asked for) not
/// strictly more frequent than every other coded word.
pub fn frequent_text(tok: &tokenizers::Tokenizer, vocab: &[String], budget: usize, rng: &mut SplitMix64) -> Result<Option<Vec<u32>>> {
    let ids: Vec<Vec<u32>> = vocab.iter().map(|w| encode(tok, &format!(" {w}"))).collect::<Result<_>>()?;
    let cost = |n: usize| zipf_counts(n, vocab.len()).iter().zip(&ids).map(|(c, w)| c * w.len()).sum::<usize>();
    // The noise word alone is more than half the words, each at least one token.
    let (mut lo, mut hi) = (0usize, 2 * budget + 16);
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if cost(mid) <= budget {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let mut counts = zipf_counts(lo, vocab.len());
    counts[0] += (budget - cost(lo)) / ids[0].len().max(1);
    let asked = &counts[1..(FREQUENT + 1).min(counts.len())];
    let rest = counts.get(FREQUENT + 1..).and_then(|r| r.iter().max().copied()).unwrap_or(0);
    if asked.len() < FREQUENT || asked.iter().any(|&c| c <= rest) {
        return Ok(None);
    }
    let mut words: Vec<usize> = counts.iter().enumerate().flat_map(|(w, &c)| std::iter::repeat_n(w, c)).collect();
    rng.shuffle(&mut words);
    let out: Vec<u32> = words.iter().flat_map(|&w| ids[w].iter().copied()).collect();
    debug_assert!(out.len() <= budget);
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_word_pool_is_distinct_and_no_word_holds_another() {
        for (i, a) in WORDS.iter().enumerate() {
            assert!(a.chars().all(|c| c.is_ascii_lowercase()), "{a}");
            for (j, b) in WORDS.iter().enumerate() {
                assert!(i == j || !b.contains(a), "{a} in {b}");
            }
        }
    }

    #[test]
    fn zipf_counts_fall_with_the_square_of_the_rank() {
        let c = zipf_counts(10_000, 6);
        assert_eq!(c, vec![6079, 1519, 675, 379, 243, 168]);
        assert_eq!(zipf_counts(0, 3), vec![0, 0, 0]);
    }

    #[test]
    fn coded_vocab_is_seeded_and_distinct() {
        let v = coded_vocab(&mut SplitMix64::new(5), 200);
        assert_eq!(v[0], NOISE);
        assert_eq!(v.iter().collect::<std::collections::HashSet<_>>().len(), 200);
        assert!(v[1..].iter().all(|w| w.len() == CODED_LEN && w.chars().all(|c| c.is_ascii_lowercase())));
        assert_eq!(v, coded_vocab(&mut SplitMix64::new(5), 200));
        assert_ne!(v, coded_vocab(&mut SplitMix64::new(6), 200));
    }
}
