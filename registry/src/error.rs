//! Errors of the HTTP API, rendered as OCI error bodies:
//! `{"errors":[{"code":"BLOB_UNKNOWN","message":"...","detail":...}]}`.

use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::store::StoreError;

/// OCI Distribution error codes (spec section "Error Codes").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Code {
    /// Blob unknown to registry.
    BlobUnknown,
    /// Blob upload invalid.
    BlobUploadInvalid,
    /// Blob upload unknown to registry.
    BlobUploadUnknown,
    /// Provided digest did not match uploaded content.
    DigestInvalid,
    /// Manifest references a manifest or blob unknown to registry.
    ManifestBlobUnknown,
    /// Manifest invalid.
    ManifestInvalid,
    /// Manifest unknown to registry.
    ManifestUnknown,
    /// Invalid repository name.
    NameInvalid,
    /// Repository name not known to registry.
    NameUnknown,
    /// Provided length did not match content length (or too large).
    SizeInvalid,
    /// Authentication required.
    Unauthorized,
    /// Requested access to the resource is denied.
    Denied,
    /// The operation is unsupported.
    Unsupported,
    /// The client sent too many requests (or failed logins): try again after `Retry-After`.
    TooManyRequests,
    /// Invalid number of results requested (distribution's, for `/v2/_catalog?n=`).
    PaginationNumberInvalid,
    /// Server-side failure (not an OCI code; clients treat it as unknown).
    Unknown,
}

impl Code {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::BlobUnknown => "BLOB_UNKNOWN",
            Code::BlobUploadInvalid => "BLOB_UPLOAD_INVALID",
            Code::BlobUploadUnknown => "BLOB_UPLOAD_UNKNOWN",
            Code::DigestInvalid => "DIGEST_INVALID",
            Code::TooManyRequests => "TOOMANYREQUESTS",
            Code::ManifestBlobUnknown => "MANIFEST_BLOB_UNKNOWN",
            Code::ManifestInvalid => "MANIFEST_INVALID",
            Code::ManifestUnknown => "MANIFEST_UNKNOWN",
            Code::NameInvalid => "NAME_INVALID",
            Code::NameUnknown => "NAME_UNKNOWN",
            Code::SizeInvalid => "SIZE_INVALID",
            Code::Unauthorized => "UNAUTHORIZED",
            Code::Denied => "DENIED",
            Code::Unsupported => "UNSUPPORTED",
            Code::PaginationNumberInvalid => "PAGINATION_NUMBER_INVALID",
            Code::Unknown => "UNKNOWN",
        }
    }
}

/// An API error: status, OCI code, message, and any extra headers (`WWW-Authenticate`,
/// `Range`).
#[derive(Debug, thiserror::Error)]
#[error("{status} {}: {message}", code.as_str())]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// OCI error code.
    pub code: Code,
    /// Human-readable message.
    pub message: String,
    /// Extra response headers.
    pub headers: Vec<(HeaderName, String)>,
    /// The error body's `detail` (`null` when `None`).
    pub detail: Option<serde_json::Value>,
}

impl ApiError {
    /// An error with the given status, code and message.
    pub fn new(status: StatusCode, code: Code, message: impl Into<String>) -> ApiError {
        ApiError { status, code, message: message.into(), headers: Vec::new(), detail: None }
    }

    /// Add a response header.
    pub fn with_header(mut self, name: HeaderName, value: impl Into<String>) -> ApiError {
        self.headers.push((name, value.into()));
        self
    }

    /// Set the error body's `detail`.
    pub fn with_detail(mut self, detail: serde_json::Value) -> ApiError {
        self.detail = Some(detail);
        self
    }

    /// 400 with `code`.
    pub fn bad(code: Code, message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, code, message)
    }

    /// 404 with `code`.
    pub fn not_found(code: Code, message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, code, message)
    }

    /// 500 for a storage failure.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, Code::Unknown, message)
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> ApiError {
        tracing::error!(error = %e, "storage error");
        ApiError::internal(format!("storage: {e}"))
    }
}

impl From<crate::inuse::InUseError> for ApiError {
    fn from(e: crate::inuse::InUseError) -> ApiError {
        use crate::inuse::InUseError as E;
        match e {
            E::Store(e) => e.into(),
            // The client retries; the push it belongs to stays correct either way.
            e => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, Code::Unknown, e.to_string()).with_header(axum::http::header::RETRY_AFTER, "5"),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({
            "errors": [{ "code": self.code.as_str(), "message": self.message, "detail": self.detail }]
        });
        let mut r = (self.status, axum::Json(body)).into_response();
        for (k, v) in self.headers {
            if let Ok(v) = HeaderValue::from_str(&v) {
                r.headers_mut().append(k, v);
            }
        }
        r
    }
}
