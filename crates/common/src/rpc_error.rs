//! The error a JSON-RPC handler of the target returns.
//!
//! Codes follow JSON-RPC 2.0 for protocol errors and SPDK's habit of negative errno values
//! for operating errors (`-17` name in use, `-19` no such device, `-16` busy), so scripts
//! written against `spdk_tgt` read the same codes.

use serde::Serialize;

/// A JSON-RPC error object: `{"code": -32602, "message": "..."}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
#[error("{message} (code {code})")]
pub struct RpcError {
    /// JSON-RPC or negative errno code.
    pub code: i32,
    /// What failed, naming the parameter or object.
    pub message: String,
}

impl RpcError {
    /// The request was not valid JSON.
    pub const PARSE_ERROR: i32 = -32700;
    /// The request was JSON but not a JSON-RPC request.
    pub const INVALID_REQUEST: i32 = -32600;
    /// No such method.
    pub const METHOD_NOT_FOUND: i32 = -32601;
    /// A parameter is missing, of the wrong type, or out of range.
    pub const INVALID_PARAMS: i32 = -32602;
    /// The handler failed for a reason of its own.
    pub const INTERNAL_ERROR: i32 = -32603;
    /// A name is already in use (`-EEXIST`).
    pub const EXISTS: i32 = -17;
    /// No object of that name (`-ENODEV`).
    pub const NO_DEVICE: i32 = -19;
    /// The object is in use (`-EBUSY`).
    pub const BUSY: i32 = -16;

    /// An error with this code and message.
    pub fn new(code: i32, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    /// An invalid-params error; the message names the parameter.
    pub fn invalid_params(message: impl Into<String>) -> Self {
        Self::new(Self::INVALID_PARAMS, message)
    }

    /// The method is not known.
    pub fn method_not_found(method: &str) -> Self {
        Self::new(
            Self::METHOD_NOT_FOUND,
            format!("method {method:?} not found"),
        )
    }

    /// A name is already taken.
    pub fn exists(message: impl Into<String>) -> Self {
        Self::new(Self::EXISTS, message)
    }

    /// No object with that name.
    pub fn no_device(message: impl Into<String>) -> Self {
        Self::new(Self::NO_DEVICE, message)
    }

    /// The object is in use.
    pub fn busy(message: impl Into<String>) -> Self {
        Self::new(Self::BUSY, message)
    }

    /// An internal failure.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(Self::INTERNAL_ERROR, message)
    }

    /// Decodes a method's parameters into its parameter struct; a failure is an
    /// invalid-params error that carries serde's message, which names the field.
    pub fn parse_params<T: serde::de::DeserializeOwned>(
        method: &str,
        params: serde_json::Value,
    ) -> Result<T, RpcError> {
        let params = if params.is_null() {
            serde_json::json!({})
        } else {
            params
        };
        serde_json::from_value(params)
            .map_err(|error| RpcError::invalid_params(format!("{method}: {error}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Params {
        #[allow(dead_code)]
        name: String,
    }

    #[test]
    fn bad_params_name_the_field() {
        let error = RpcError::parse_params::<Params>("m", serde_json::json!({"nme": "x"}))
            .expect_err("unknown field must be refused");
        assert_eq!(error.code, RpcError::INVALID_PARAMS);
        assert!(error.message.contains("nme"), "{}", error.message);
        let error = RpcError::parse_params::<Params>("m", serde_json::json!({"name": 3}))
            .expect_err("wrong type must be refused");
        assert!(
            error.message.starts_with("m: invalid type"),
            "{}",
            error.message
        );
    }

    #[test]
    fn null_params_read_as_empty_object() {
        let error = RpcError::parse_params::<Params>("m", serde_json::Value::Null)
            .expect_err("missing field");
        assert!(
            error.message.contains("missing field `name`"),
            "{}",
            error.message
        );
    }
}
