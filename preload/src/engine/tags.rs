//! Tags: the current tag of each thread, and the book of every tag ever set, with whether it is
//! paused and where its memory lives.
//!
//! The current tag is **per thread**, like `torch_memory_saver`'s region: PyTorch allocates on
//! the thread that creates the tensor, so a tag set by the Python thread tags that thread's
//! allocations only, and allocations made meanwhile by other threads (data loaders, NCCL's
//! proxy thread, a second model) are not swept into a pause by accident.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use crate::cuda::codes::Fail;

/// Longest tag accepted, in bytes.
pub const MAX_TAG_LEN: usize = 255;

thread_local! {
    static CURRENT: RefCell<Option<Arc<str>>> = const { RefCell::new(None) };
}

/// Checks a tag from the C ABI: UTF-8, at most [`MAX_TAG_LEN`] bytes, no NUL. Empty means
/// "untagged" (`None`).
pub fn parse_tag(bytes: &[u8]) -> Result<Option<&str>, Fail> {
    if bytes.is_empty() {
        return Ok(None);
    }
    if bytes.len() > MAX_TAG_LEN {
        return Err(Fail::InvalidValue(format!(
            "a tag of {} bytes (at most {MAX_TAG_LEN})",
            bytes.len()
        )));
    }
    std::str::from_utf8(bytes)
        .map(Some)
        .map_err(|_| Fail::InvalidValue("a tag that is not UTF-8".into()))
}

/// Sets this thread's tag (`None`: untagged).
pub fn set_current(tag: Option<Arc<str>>) {
    // During thread teardown the slot may be gone; then there is nothing to tag anyway.
    let _ = CURRENT.try_with(|current| *current.borrow_mut() = tag);
}

/// This thread's tag.
pub fn current() -> Option<Arc<str>> {
    CURRENT
        .try_with(|current| current.borrow().clone())
        .ok()
        .flatten()
}

/// What the book knows about one tag.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TagState {
    pub paused: bool,
    /// Devices that ever held memory of this tag.
    pub devices: BTreeSet<usize>,
    pub allocations: usize,
    pub live_bytes: usize,
    pub pauses: u64,
    pub resumes: u64,
}

/// Every tag ever set, by name.
#[derive(Debug, Default)]
pub struct TagBook {
    tags: BTreeMap<Arc<str>, TagState>,
}

/// What a pause or resume has to do: the tags to act on, each with its devices.
pub type Plan = Vec<(Arc<str>, Vec<usize>)>;

impl TagBook {
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes `tag` known (setting a tag does this) and returns the book's shared name for it.
    pub fn register(&mut self, tag: &str) -> Arc<str> {
        if let Some((name, _)) = self.tags.get_key_value(tag) {
            return name.clone();
        }
        let name: Arc<str> = Arc::from(tag);
        self.tags.insert(name.clone(), TagState::default());
        name
    }

    pub fn get(&self, tag: &str) -> Option<&TagState> {
        self.tags.get(tag)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&Arc<str>, &TagState)> {
        self.tags.iter()
    }

    /// Whether an allocation under `tag` may go ahead: not while the tag is paused (its
    /// addresses have no memory behind them; a new allocation would be lost at resume).
    pub fn check_alloc(&self, tag: &str) -> Result<(), Fail> {
        match self.tags.get(tag) {
            Some(state) if state.paused => Err(Fail::NotPermitted(format!(
                "tag {tag:?} is paused: resume it before allocating under it"
            ))),
            _ => Ok(()),
        }
    }

    pub fn allocated(&mut self, tag: &str, device: usize, bytes: usize) {
        let state = self.tags.entry(Arc::from(tag)).or_default();
        state.devices.insert(device);
        state.allocations += 1;
        state.live_bytes += bytes;
    }

    pub fn freed(&mut self, tag: &str, bytes: usize) {
        if let Some(state) = self.tags.get_mut(tag) {
            state.allocations = state.allocations.saturating_sub(1);
            state.live_bytes = state.live_bytes.saturating_sub(bytes);
        }
    }

    /// The tags a pause of `tag` (`None`: every tag) must act on. Tags already paused are left
    /// out (pausing twice is a no-op); a tag never set is [`Fail::UnknownTag`].
    pub fn plan_pause(&self, tag: Option<&str>) -> Result<Plan, Fail> {
        self.plan(tag, false)
    }

    /// The tags a resume must act on: the paused ones (resuming an awake tag is a no-op).
    pub fn plan_resume(&self, tag: Option<&str>) -> Result<Plan, Fail> {
        self.plan(tag, true)
    }

    fn plan(&self, tag: Option<&str>, paused: bool) -> Result<Plan, Fail> {
        let pick = |(name, state): (&Arc<str>, &TagState)| {
            (state.paused == paused)
                .then(|| (name.clone(), state.devices.iter().copied().collect()))
        };
        match tag {
            Some(tag) => {
                let (name, state) = self
                    .tags
                    .get_key_value(tag)
                    .ok_or_else(|| Fail::UnknownTag(tag.to_string()))?;
                Ok(pick((name, state)).into_iter().collect())
            }
            None => Ok(self.tags.iter().filter_map(pick).collect()),
        }
    }

    pub fn mark_paused(&mut self, tag: &str, paused: bool) {
        if let Some(state) = self.tags.get_mut(tag) {
            if state.paused != paused {
                if paused {
                    state.pauses += 1;
                } else {
                    state.resumes += 1;
                }
            }
            state.paused = paused;
        }
    }

    pub fn len(&self) -> usize {
        self.tags.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tags.is_empty()
    }

    pub fn paused_count(&self) -> usize {
        self.tags.values().filter(|s| s.paused).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_checked_at_the_abi() {
        assert_eq!(parse_tag(b""), Ok(None));
        assert_eq!(parse_tag(b"weights"), Ok(Some("weights")));
        assert!(matches!(
            parse_tag(&[0xff, 0xfe]),
            Err(Fail::InvalidValue(_))
        ));
        assert!(matches!(
            parse_tag(&[b'a'; MAX_TAG_LEN + 1]),
            Err(Fail::InvalidValue(_))
        ));
        assert!(parse_tag(&[b'a'; MAX_TAG_LEN]).is_ok());
    }

    #[test]
    fn the_current_tag_is_per_thread() {
        set_current(Some(Arc::from("weights")));
        assert_eq!(current().as_deref(), Some("weights"));
        let other = std::thread::spawn(current).join().unwrap();
        assert_eq!(other, None, "another thread is untagged");
        std::thread::spawn(|| set_current(Some(Arc::from("kv"))))
            .join()
            .unwrap();
        assert_eq!(
            current().as_deref(),
            Some("weights"),
            "unchanged by the other thread"
        );
        set_current(None);
        assert_eq!(current(), None);
    }

    #[test]
    fn register_interns_names() {
        let mut book = TagBook::new();
        let a = book.register("weights");
        let b = book.register("weights");
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(book.len(), 1);
    }

    #[test]
    fn pause_and_resume_plans_are_idempotent() {
        let mut book = TagBook::new();
        book.register("weights");
        book.register("kv");
        book.allocated("weights", 0, 100);
        book.allocated("weights", 1, 50);
        let plan = book.plan_pause(Some("weights")).unwrap();
        assert_eq!(plan, vec![(Arc::from("weights"), vec![0, 1])]);
        book.mark_paused("weights", true);
        assert!(
            book.plan_pause(Some("weights")).unwrap().is_empty(),
            "second pause: no-op"
        );
        assert_eq!(book.plan_resume(Some("weights")).unwrap().len(), 1);
        assert!(
            book.plan_resume(Some("kv")).unwrap().is_empty(),
            "awake: no-op"
        );
        book.mark_paused("weights", false);
        assert!(book.plan_resume(Some("weights")).unwrap().is_empty());
        let state = book.get("weights").unwrap();
        assert_eq!((state.pauses, state.resumes), (1, 1));
    }

    #[test]
    fn unknown_tags_are_an_error_and_none_means_all() {
        let mut book = TagBook::new();
        assert_eq!(
            book.plan_pause(Some("nope")),
            Err(Fail::UnknownTag("nope".into()))
        );
        assert_eq!(
            book.plan_resume(Some("nope")),
            Err(Fail::UnknownTag("nope".into()))
        );
        book.register("a");
        book.register("b");
        book.mark_paused("b", true);
        let all: Vec<_> = book
            .plan_pause(None)
            .unwrap()
            .into_iter()
            .map(|(t, _)| t)
            .collect();
        assert_eq!(all, vec![Arc::from("a")], "b is paused already");
        assert_eq!(book.paused_count(), 1);
    }

    #[test]
    fn allocating_under_a_paused_tag_is_refused() {
        let mut book = TagBook::new();
        book.register("w");
        assert!(book.check_alloc("w").is_ok());
        book.mark_paused("w", true);
        assert!(matches!(book.check_alloc("w"), Err(Fail::NotPermitted(_))));
        assert!(book.check_alloc("other").is_ok());
        book.allocated("w", 0, 10);
        book.allocated("w", 0, 20);
        book.freed("w", 10);
        let state = book.get("w").unwrap();
        assert_eq!((state.allocations, state.live_bytes), (1, 20));
    }
}
