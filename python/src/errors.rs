//! ferry's typed errors as the exception classes of `ferry/_errors.py`.
//!
//! Each Rust error maps to the name of one class and, where the error is
//! about one op or descriptor, its index. The classes live in Python so that
//! they can derive from two bases (`FerryError` and `TimeoutError`, say),
//! which PyO3's `create_exception!` cannot.

use ferry::layout::{LayoutError, RequestError};
use ferry::weights::WeightsError;
use ferry::{
    DescError, LookupError, MessageError, MetadataError, NotifyError, OpError, PlanError,
    PostError, PrepareError, RegisterError, RpcError, SubmitError, XferError,
};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

/// A ferry error on its way to Python: the class to raise, the message,
/// the failing op's or descriptor's index, and the numbers a handler
/// branches on (a weight set's rank and version) as attributes.
pub struct Raise {
    class: &'static str,
    message: String,
    index: Option<usize>,
    attrs: Vec<(&'static str, u64)>,
    /// Attributes that are names (a tensor's).
    texts: Vec<(&'static str, String)>,
}

impl Raise {
    /// `class` (a name in `ferry._errors`) with `message`.
    pub fn new(class: &'static str, message: impl ToString) -> Self {
        Raise {
            class,
            message: message.to_string(),
            index: None,
            attrs: Vec::new(),
            texts: Vec::new(),
        }
    }

    /// The same, with attribute `name` set to `value` on the exception.
    pub fn with(mut self, name: &'static str, value: impl Into<u64>) -> Self {
        self.attrs.push((name, value.into()));
        self
    }

    /// The same, with attribute `name` set to the string `value`.
    pub fn with_text(mut self, name: &'static str, value: &str) -> Self {
        self.texts.push((name, value.to_string()));
        self
    }

    /// The same class, with the text of the error that wraps it (which
    /// names the op, the owner, ...).
    fn saying(mut self, outer: &impl ToString) -> Self {
        self.message = outer.to_string();
        self
    }

    /// The same, about op or descriptor `index`.
    pub fn at(mut self, index: usize) -> Self {
        self.index = Some(index);
        self
    }

    /// The exception, as an object (for a callback that settles a future).
    pub fn into_value(self, py: Python<'_>) -> Py<PyAny> {
        match self.instantiate(py) {
            Ok(value) => value,
            Err(error) => error.into_value(py).into_any(),
        }
    }

    fn instantiate(self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        static MODULE: PyOnceLock<Py<PyModule>> = PyOnceLock::new();
        let module =
            MODULE.get_or_try_init(py, || py.import("ferry._errors").map(|m| m.unbind()))?;
        let class = module.bind(py).getattr(self.class)?;
        let value = class.call1((self.message, self.index))?;
        for (name, number) in self.attrs {
            value.setattr(name, number)?;
        }
        for (name, text) in self.texts {
            value.setattr(name, text)?;
        }
        Ok(value.unbind())
    }
}

impl From<Raise> for PyErr {
    fn from(raise: Raise) -> PyErr {
        Python::attach(|py| match raise.instantiate(py) {
            Ok(value) => PyErr::from_value(value.into_bound(py)),
            Err(error) => error,
        })
    }
}

/// The class an op's error maps to.
pub fn op(error: &OpError) -> Raise {
    let class = match error {
        OpError::OutOfBounds { .. } => "OutOfBounds",
        OpError::InvertedRange { .. }
        | OpError::NegativeOffset(_)
        | OpError::AddressOverflow { .. } => "InvalidRange",
        OpError::LengthMismatch { .. } => "LengthMismatch",
        OpError::ReadOnly => "ReadOnly",
        OpError::AccessDenied => "AccessDenied",
        OpError::StaleGeneration { .. } => "StaleRegion",
        OpError::UnknownRegion => "RegionGone",
        OpError::UnknownNode { .. } => "UnknownNode",
        OpError::PeerUnreachable { .. } => "PeerUnreachable",
        OpError::ConnectionLost { .. } => "ConnectionLost",
        OpError::NoSharedTransport => "NoSharedTransport",
        OpError::Protocol(_) => "ProtocolError",
        OpError::PeerBusy { .. } => "PeerBusy",
        OpError::AuthFailed { .. } => "AuthFailed",
        // A variant added later: still a ferry error, with its text.
        #[allow(unreachable_patterns)]
        _ => "FerryError",
    };
    Raise::new(class, error)
}

/// A submit's error: the failing op's class and index, or the deadline.
pub fn submit(error: &SubmitError) -> Raise {
    match error {
        SubmitError::Op {
            index,
            error: op_error,
        } => op(op_error).saying(error).at(*index),
        SubmitError::Timeout { .. } => Raise::new("Timeout", error),
        SubmitError::BackendStopped => Raise::new("BackendStopped", error),
        SubmitError::ShutDown => Raise::new("ShutDown", error),
        _ => Raise::new("FerryError", error),
    }
}

/// A notified submit's error.
pub fn notify(error: &NotifyError) -> Raise {
    match error {
        NotifyError::Submit(inner) => submit(inner),
        NotifyError::TooLarge { .. } => Raise::new("TooLarge", error),
        NotifyError::Notification { error: inner, .. } => message(inner).saying(error),
        _ => Raise::new("FerryError", error),
    }
}

/// A registration's error.
pub fn register(error: &RegisterError) -> Raise {
    let class = match error {
        RegisterError::ZeroLength => "InvalidArgument",
        RegisterError::OutOfMemory(_) => "OutOfMemory",
        RegisterError::TooLarge(_) => "TooLarge",
        RegisterError::BackendStopped => "BackendStopped",
        RegisterError::ShutDown => "ShutDown",
        _ => "FerryError",
    };
    Raise::new(class, error)
}

/// A descriptor list's or request's error, naming the descriptor.
pub fn desc(error: &DescError) -> Raise {
    match error {
        DescError::NoSuchRegion { index, .. } => Raise::new("OutOfBounds", error).at(*index),
        DescError::Descriptor {
            index,
            error: op_error,
        } => op(op_error).saying(error).at(*index),
        DescError::Region {
            region,
            error: op_error,
        } => op(op_error).saying(error).at(*region),
        DescError::IndexOutOfRange { position, .. } => {
            Raise::new("OutOfBounds", error).at(*position)
        }
        DescError::CountMismatch { .. } => Raise::new("InvalidArgument", error),
        _ => Raise::new("FerryError", error),
    }
}

/// A prepare's error.
pub fn prepare(error: &PrepareError) -> Raise {
    match error {
        PrepareError::Desc(inner) => desc(inner),
        PrepareError::Connect {
            error: op_error, ..
        } => op(op_error).saying(error),
        PrepareError::ShutDown => Raise::new("ShutDown", error),
        _ => Raise::new("FerryError", error),
    }
}

/// A transfer request's error.
pub fn xfer(error: &XferError) -> Raise {
    match error {
        XferError::Submit(inner) => submit(inner),
        XferError::Notify(inner) => notify(inner),
        XferError::Cancelled { .. } => Raise::new("Cancelled", error),
        XferError::NotPosted => Raise::new("FerryError", error),
        XferError::Desc(inner) => desc(inner),
        _ => Raise::new("FerryError", error),
    }
}

/// A post's error.
pub fn post(error: &PostError) -> Raise {
    Raise::new("InProgress", error)
}

/// A message's error.
pub fn message(error: &MessageError) -> Raise {
    let class = match error {
        MessageError::TooLarge { .. } => "TooLarge",
        MessageError::Timeout { .. } => "Timeout",
        MessageError::Unreachable { .. } => "PeerUnreachable",
        MessageError::ConnectionLost { .. } => "ConnectionLost",
        MessageError::Busy { .. } => "PeerBusy",
        MessageError::AuthFailed { .. } => "AuthFailed",
        MessageError::ShutDown => "ShutDown",
        MessageError::NodeStopped => "ConnectionLost",
        _ => "FerryError",
    };
    Raise::new(class, error)
}

/// An RPC's error.
pub fn rpc(error: &RpcError) -> Raise {
    let class = match error {
        RpcError::NoSuchHandler { .. } => "NoSuchHandler",
        RpcError::Failed { .. } => "RemoteError",
        RpcError::Timeout { .. } => "Timeout",
        RpcError::Unreachable { .. } => "PeerUnreachable",
        RpcError::ConnectionLost { .. } | RpcError::NodeStopped => "ConnectionLost",
        RpcError::Busy { .. } => "PeerBusy",
        RpcError::AuthFailed { .. } => "AuthFailed",
        RpcError::TooLarge { .. } | RpcError::AnswerTooLarge { .. } => "TooLarge",
        RpcError::BadName(_) => "InvalidArgument",
        RpcError::NameTaken(_) => "InvalidArgument",
        RpcError::ShutDown => "ShutDown",
        RpcError::Protocol { .. } => "ProtocolError",
        _ => "FerryError",
    };
    Raise::new(class, error)
}

/// A name lookup's error.
pub fn lookup(error: &LookupError) -> Raise {
    Raise::new("NotFound", error)
}

/// A metadata blob's error.
pub fn metadata(error: &MetadataError) -> Raise {
    Raise::new("MetadataError", error)
}

/// A plan's error: bad layouts and regions that do not fit them are
/// `LayoutError`, block tables that do not fit the plan `BlockTableError`.
pub fn plan(error: &PlanError) -> Raise {
    match error {
        PlanError::Request(_) => Raise::new("BlockTableError", error),
        PlanError::Prepare(inner) => prepare(inner),
        PlanError::Desc(inner) => desc(inner),
        // A peer that publishes no layout under the name.
        PlanError::Lookup(_) => Raise::new("NotFound", error),
        PlanError::Layout(_)
        | PlanError::RegionCount { .. }
        | PlanError::RegionTooShort { .. }
        | PlanError::DuplicateRank(_)
        | PlanError::LayoutChanged { .. } => Raise::new("LayoutError", error),
        _ => Raise::new("FerryError", error),
    }
}

/// A layout the planner refused (planning without a node).
pub fn layout(error: &LayoutError) -> Raise {
    Raise::new("LayoutError", error)
}

/// A request the planner refused (planning without a node).
pub fn request(error: &RequestError) -> Raise {
    Raise::new("BlockTableError", error)
}

/// A bad argument found here, before ferry saw it.
pub fn invalid(message: impl ToString) -> Raise {
    Raise::new("InvalidArgument", message)
}

/// A weight set's error. Layouts that do not plan and transfers that fail
/// keep their own classes (`LayoutError`, `ConnectionLost`, ...): a caller
/// handles them as it does for any plan or transfer.
pub fn weights(error: &WeightsError) -> Raise {
    match error {
        WeightsError::NoCompleteVersion => Raise::new("NoCompleteVersion", error),
        WeightsError::Overwritten { rank, version } => Raise::new("Overwritten", error)
            .with("rank", *rank)
            .with("version", *version),
        // u32::MAX: a publisher not reached yet, whose rank is unknown.
        WeightsError::PublisherLost { rank, .. } if *rank == u32::MAX => {
            Raise::new("PublisherLost", error)
        }
        WeightsError::PublisherLost { rank, .. } => {
            Raise::new("PublisherLost", error).with("rank", *rank)
        }
        WeightsError::ChecksumMismatch {
            tensor,
            rank,
            version,
        } => Raise::new("ChecksumMismatch", error)
            .with("rank", *rank)
            .with("version", *version)
            .with_text("tensor", tensor),
        WeightsError::ReadersHold { buffer } => {
            Raise::new("ReadersHold", error).with("buffer", *buffer as u64)
        }
        WeightsError::VersionNotNewer { version, last } => Raise::new("VersionNotNewer", error)
            .with("version", *version)
            .with("last", *last),
        WeightsError::Plan(inner) => plan(inner),
        WeightsError::Xfer(inner) => xfer(inner),
        WeightsError::Protocol(_) => Raise::new("ProtocolError", error),
        WeightsError::ShutDown => Raise::new("ShutDown", error),
        _ => Raise::new("WeightsError", error),
    }
}
