//! How a manager actor answers a transfer without a task hop when it can,
//! and without making its mailbox wait on a transfer when it cannot.
//!
//! A small transfer often completes within microseconds of being posted,
//! while its submitter polls for it inline. Handing every submit to a task
//! of its own costs two extra wake-ups on the way (mailbox to task, task to
//! caller), often on another thread: more than the transfer itself. So
//! [`answer`] polls the transfer's future once in the handler, *lending* the
//! actor's thread to it, and answers at once if that poll completes it.
//! Otherwise, or as soon as another message waits in the actor's mailbox
//! (transports check [`wanted_back`] while they poll inline), the future goes
//! on in a task of its own, which answers when it is done. Either way the
//! mailbox waits for at most one short poll, never for a transfer.

use std::cell::RefCell;
use std::future::Future;
use std::rc::Rc;
use std::task::Poll;

use kameo::Actor;
use kameo::message::Context;
use kameo::reply::{DelegatedReply, Reply};

use crate::{Answer, SubmitError};

/// Says whether the lender of a thread wants it back.
pub type Lender = Rc<dyn Fn() -> bool>;

thread_local! {
    /// Set while a thread is lent.
    static LENDER: RefCell<Option<Lender>> = const { RefCell::new(None) };
}

/// Runs `f` on a thread lent by code that wants it back when `wanted`
/// returns true; inline polling inside `f` stops then ([`wanted_back`]).
pub fn lend<R>(wanted: Lender, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Lender>);
    impl Drop for Restore {
        fn drop(&mut self) {
            LENDER.with(|l| *l.borrow_mut() = self.0.take());
        }
    }
    let _restore = Restore(LENDER.with(|l| l.borrow_mut().replace(wanted)));
    f()
}

/// Whether the code that lent this thread wants it back: a transport
/// polling inline stops and leaves the rest to its async path. False when
/// the thread is not lent.
pub fn wanted_back() -> bool {
    LENDER.with(|l| l.borrow().as_ref().is_some_and(|wanted| wanted()))
}

/// Answers the message being handled with `work`'s outcome: at once if one
/// poll of it, on the actor's lent thread, completes it; else from a task of
/// its own. The thread is wanted back as soon as another message waits in
/// the actor's mailbox (always, for an unbounded mailbox, whose length is
/// not known).
pub fn answer<A, R, F>(ctx: &mut Context<A, DelegatedReply<R>>, work: F) -> DelegatedReply<R>
where
    A: Actor,
    R: Reply<Value = R>,
    F: Future<Output = R> + Send + 'static,
{
    let mut work = Box::pin(work);
    let first = {
        let mailbox = ctx.actor_ref().mailbox_sender().clone();
        let waiting: Lender = Rc::new(move || match (mailbox.capacity(), mailbox.max_capacity()) {
            (Some(free), Some(max)) => free < max,
            _ => true,
        });
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        // Polling with a waker that does nothing is sound: the task that
        // takes the future over polls it again at once, and every future
        // re-registers its waker on each poll.
        lend(waiting, || work.as_mut().poll(&mut cx))
    };
    match first {
        Poll::Ready(outcome) => ctx.reply(outcome),
        Poll::Pending => ctx.spawn(work),
    }
}

/// Answers the message being handled from whichever thread finishes the
/// transfer: `start` gets an [`Answer`] that replies to the caller, and
/// returns the future that sets the transfer going (queueing it, which
/// usually completes on its first poll, here on the actor's thread). Only
/// if that future has more to do does it go on in a task of its own. No
/// task waits for the transfer itself: that saves the task hop and the
/// wake-ups [`answer`] pays when a transfer outlives its first poll.
pub fn answer_on_completion<A, S, F>(
    ctx: &mut Context<A, DelegatedReply<Result<(), SubmitError>>>,
    start: S,
) -> DelegatedReply<Result<(), SubmitError>>
where
    A: Actor,
    S: FnOnce(Answer) -> F,
    F: Future<Output = ()> + Send + 'static,
{
    let (delegated, sender) = ctx.reply_sender();
    let answer: Answer = Box::new(move |result| {
        if let Some(sender) = sender {
            sender.send(result);
        }
    });
    let mut started = Box::pin(start(answer));
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    // A waker that does nothing is sound here for the reason given in
    // `answer`: the task that takes the future over polls it at once.
    if started.as_mut().poll(&mut cx).is_pending() {
        tokio::spawn(started);
    }
    delegated
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lent_thread_is_wanted_back_only_while_lent() {
        assert!(!wanted_back(), "not lent");
        let wanted = Rc::new(std::cell::Cell::new(false));
        let flag = wanted.clone();
        lend(Rc::new(move || flag.get()), || {
            assert!(!wanted_back());
            wanted.set(true);
            assert!(wanted_back());
            // Nested lending: the inner lender decides, then the outer again.
            lend(Rc::new(|| false), || assert!(!wanted_back()));
            assert!(wanted_back());
        });
        assert!(!wanted_back(), "returned");
        let unwound = std::panic::catch_unwind(|| lend(Rc::new(|| true), || panic!("inside")));
        assert!(unwound.is_err());
        assert!(!wanted_back(), "restored after a panic");
    }
}
