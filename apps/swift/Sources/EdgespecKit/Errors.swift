import Foundation

/// The server's OpenAI-style error body: `{"error": {"message", "type", "param", "code"}}`.
public struct ServerError: Codable, Sendable, Equatable, CustomStringConvertible {
    public let message: String
    public let type: String
    /// The request field at fault, e.g. `temperature` or `messages.0.role`.
    public let param: String?
    /// e.g. `invalid_value`, `unknown_field`, `invalid_api_key`, `queue_full`.
    public let code: String?

    public init(message: String, type: String, param: String? = nil, code: String? = nil) {
        self.message = message
        self.type = type
        self.param = param
        self.code = code
    }

    public var description: String {
        var s = "\(code ?? type): \(message)"
        if let param { s += " (param: \(param))" }
        return s
    }
}

struct ErrorEnvelope: Codable {
    let error: ServerError
}

/// Everything the client throws, besides `CancellationError` when its task is cancelled.
public enum EdgespecError: Error, Sendable, Equatable {
    /// 400: the request is invalid; `param` names the field (`invalid_value`,
    /// `unknown_field`, `missing_field`, `invalid_json`, `invalid_prompt`,
    /// `context_length_exceeded`, `invalid_request`).
    case badRequest(ServerError)
    /// 401 `invalid_api_key`: the bearer token is missing or wrong.
    case unauthorized(ServerError)
    /// 404: `model_not_found`, or an unknown path (code `nil`).
    case notFound(ServerError)
    /// 413 `body_too_large`: the body is over the server's limit (4 MiB).
    case payloadTooLarge(ServerError)
    /// 503 `queue_full`: the server's queue is full; `retryAfter` is its `Retry-After`
    /// in seconds. Thrown once the client's `RetryPolicy` is used up.
    case queueFull(ServerError, retryAfter: TimeInterval?)
    /// Any other status with an error body (405, 500 `generation_failed`, ...).
    case server(status: Int, ServerError)
    /// A status >= 400 whose body is not an error body (e.g. from a proxy).
    case unexpectedResponse(status: Int, body: String)
    /// The generation failed after streaming began: the server sent an error event.
    case streamFailed(ServerError)
    /// The stream ended without `data: [DONE]` (the connection dropped mid-reply).
    case streamTruncated
    /// The server could not be reached, or the connection failed or timed out.
    case connection(String)
    /// A successful response whose body does not have the expected shape.
    case decoding(String)

    /// The HTTP status, for errors that carry one.
    public var status: Int? {
        switch self {
        case .badRequest: return 400
        case .unauthorized: return 401
        case .notFound: return 404
        case .payloadTooLarge: return 413
        case .queueFull: return 503
        case .server(let status, _), .unexpectedResponse(let status, _): return status
        default: return nil
        }
    }

    /// The server's error body, for errors that carry one.
    public var serverError: ServerError? {
        switch self {
        case .badRequest(let e), .unauthorized(let e), .notFound(let e), .payloadTooLarge(let e),
             .queueFull(let e, _), .server(_, let e), .streamFailed(let e):
            return e
        default:
            return nil
        }
    }

    public var code: String? { serverError?.code }
    public var param: String? { serverError?.param }

    /// Maps a response with status >= 400 to an error.
    public static func from(status: Int, body: Data, retryAfter: String? = nil) -> EdgespecError {
        guard let envelope = try? JSONDecoder().decode(ErrorEnvelope.self, from: body) else {
            return .unexpectedResponse(status: status, body: String(decoding: body.prefix(2048), as: UTF8.self))
        }
        let e = envelope.error
        switch status {
        case 400: return .badRequest(e)
        case 401: return .unauthorized(e)
        case 404: return .notFound(e)
        case 413: return .payloadTooLarge(e)
        case 503 where e.code == "queue_full": return .queueFull(e, retryAfter: parseRetryAfter(retryAfter))
        default: return .server(status: status, e)
        }
    }

    /// `Retry-After` in delta-seconds (the form the server sends); an HTTP date is ignored.
    static func parseRetryAfter(_ value: String?) -> TimeInterval? {
        guard let value, let seconds = Double(value.trimmingCharacters(in: .whitespaces)),
              seconds.isFinite, seconds >= 0
        else { return nil }
        return seconds
    }
}

extension EdgespecError: LocalizedError {
    public var errorDescription: String? {
        switch self {
        case .badRequest(let e): return "bad request: \(e)"
        case .unauthorized(let e): return "unauthorized: \(e)"
        case .notFound(let e): return "not found: \(e)"
        case .payloadTooLarge(let e): return "request too large: \(e)"
        case .queueFull(let e, let retryAfter):
            return "server busy: \(e)" + (retryAfter.map { " (retry after \($0) s)" } ?? "")
        case .server(let status, let e): return "server error \(status): \(e)"
        case .unexpectedResponse(let status, let body): return "HTTP \(status): \(body)"
        case .streamFailed(let e): return "generation failed mid-stream: \(e)"
        case .streamTruncated: return "the stream ended before [DONE]"
        case .connection(let message): return "connection failed: \(message)"
        case .decoding(let message): return "unexpected response: \(message)"
        }
    }
}

/// How the client answers `503 queue_full`: wait as long as `Retry-After` says (or
/// `defaultDelay` when absent), at most `maxDelay`, and try again, at most `maxRetries`
/// times. Nothing else is retried: a request that reached the engine is never resent.
public struct RetryPolicy: Sendable, Equatable {
    public var maxRetries: Int
    public var defaultDelay: TimeInterval
    public var maxDelay: TimeInterval

    public init(maxRetries: Int = 3, defaultDelay: TimeInterval = 1, maxDelay: TimeInterval = 10) {
        self.maxRetries = max(0, maxRetries)
        self.defaultDelay = max(0, defaultDelay)
        self.maxDelay = max(0, maxDelay)
    }

    /// Never retry: `queueFull` is thrown at once.
    public static let none = RetryPolicy(maxRetries: 0)
    /// Three retries, honouring `Retry-After` up to 10 s each.
    public static let standard = RetryPolicy()

    /// Seconds to wait before retry number `retry` (1-based) after `error`; `nil` means
    /// give up and throw `error`.
    public func delay(beforeRetry retry: Int, after error: EdgespecError) -> TimeInterval? {
        guard retry <= maxRetries, case .queueFull(_, let retryAfter) = error else { return nil }
        return min(retryAfter ?? defaultDelay, maxDelay)
    }
}
