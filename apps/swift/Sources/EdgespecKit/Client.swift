import Foundation
#if canImport(FoundationNetworking)
import FoundationNetworking
#endif

/// A client of `edgespec serve` (docs/server.md).
///
/// ```swift
/// let client = EdgespecClient(baseURL: URL(string: "http://127.0.0.1:8080/v1")!, apiKey: key)
/// let request = ChatRequest(messages: [.user("Name three colours.")], options: .init(maxTokens: 64))
/// for try await chunk in client.streamChat(request) {
///     print(chunk.text, terminator: "")
/// }
/// ```
///
/// Cancelling the task that consumes a stream (or dropping the stream) closes the
/// connection, and the server stops that generation at its next token.
public struct EdgespecClient: Sendable {
    /// The server's root, e.g. `http://127.0.0.1:8080` (a URL ending in `/v1`, as
    /// `edgespec serve` prints it, is accepted too).
    public let baseURL: URL
    /// Sent as `Authorization: Bearer <apiKey>` (servers started with `--api-key`).
    public var apiKey: String?
    /// What to do when the server's queue is full (`503 queue_full`).
    public var retryPolicy: RetryPolicy
    /// The longest the client waits for the next byte: a request waits silently in the
    /// server's queue, and a non-streamed reply arrives only when it is complete.
    public var timeout: TimeInterval

    public init(baseURL: URL = URL(string: "http://127.0.0.1:8080")!, apiKey: String? = nil,
                retryPolicy: RetryPolicy = .standard, timeout: TimeInterval = 600)
    {
        self.baseURL = Self.root(of: baseURL)
        self.apiKey = apiKey
        self.retryPolicy = retryPolicy
        self.timeout = timeout
    }

    // MARK: Endpoints

    /// `GET /health`: liveness, the modes, queue figures (needs no token).
    public func health() async throws -> Health {
        try await fetch(get("health"))
    }

    /// `GET /v1/models`: the served model's id, then `"default"`, then the models stored by hub name.
    public func models() async throws -> [ModelInfo] {
        let list: ModelList = try await fetch(get("v1/models"))
        return list.data
    }

    /// The models stored on the server's machine by hub name (`edgespec pull ORG/NAME`); any of them
    /// may be named in a request's `model`.
    public func storedModels() async throws -> [ModelInfo] {
        try await models().filter(\.isStored)
    }

    /// `GET /v1/models/{id}`.
    public func model(_ id: String) async throws -> ModelInfo {
        let escaped = id.addingPercentEncoding(withAllowedCharacters: .urlPathAllowed.subtracting(["/"])) ?? id
        return try await fetch(get("v1/models/" + escaped))
    }

    /// A whole chat reply (`"stream": false`).
    public func chat(_ request: ChatRequest) async throws -> ChatCompletion {
        var body = request
        body.stream = false
        return try await fetch(post("v1/chat/completions", body, streaming: false))
    }

    /// A chat reply decoded into a `StructuredOutput` type: the request's response format
    /// is set to the type's JSON schema, so the server constrains the reply to it.
    public func chat<T: StructuredOutput>(_ request: ChatRequest, as type: T.Type) async throws -> T {
        var body = request
        body.responseFormat = .type(T.self)
        return try await chat(body).decode(T.self)
    }

    /// A chat reply as it is generated: the role chunk, one chunk per piece of text, the
    /// chunk with the finish reason and `edgespec` stats, then (with `includeUsage`) a
    /// chunk with `usage`.
    public func streamChat(_ request: ChatRequest) -> AsyncThrowingStream<ChatCompletionChunk, Error> {
        var body = request
        body.stream = true
        return events(encoding: { try post("v1/chat/completions", body, streaming: true) })
    }

    /// A raw text continuation (`"stream": false`).
    public func complete(_ request: CompletionRequest) async throws -> Completion {
        var body = request
        body.stream = false
        return try await fetch(post("v1/completions", body, streaming: false))
    }

    /// A raw text continuation as it is generated.
    public func streamCompletion(_ request: CompletionRequest) -> AsyncThrowingStream<CompletionChunk, Error> {
        var body = request
        body.stream = true
        return events(encoding: { try post("v1/completions", body, streaming: true) })
    }

    // MARK: Plumbing

    static func root(of url: URL) -> URL {
        var s = url.absoluteString
        while s.hasSuffix("/") { s.removeLast() }
        if s.hasSuffix("/v1") { s.removeLast(3) }
        return URL(string: s) ?? url
    }

    func url(_ path: String) -> URL {
        URL(string: baseURL.absoluteString + "/" + path)!
    }

    func get(_ path: String) -> URLRequest {
        var r = URLRequest(url: url(path))
        r.httpMethod = "GET"
        r.setValue("application/json", forHTTPHeaderField: "Accept")
        authorize(&r)
        return r
    }

    func post<Body: Encodable>(_ path: String, _ body: Body, streaming: Bool) throws -> URLRequest {
        var r = URLRequest(url: url(path))
        r.httpMethod = "POST"
        r.setValue("application/json", forHTTPHeaderField: "Content-Type")
        r.setValue(streaming ? "text/event-stream" : "application/json", forHTTPHeaderField: "Accept")
        do {
            r.httpBody = try (body as? OrderedJSONBody)?.jsonBody() ?? JSONEncoder().encode(body)
        } catch {
            throw EdgespecError.decoding("cannot encode the request: \(error)")
        }
        authorize(&r)
        return r
    }

    private func authorize(_ r: inout URLRequest) {
        if let apiKey, !apiKey.isEmpty {
            r.setValue("Bearer \(apiKey)", forHTTPHeaderField: "Authorization")
        }
    }

    /// Sends `request` until it gets a 2xx head (retrying `503 queue_full` as the policy
    /// allows) and returns the head and the rest of the response to read.
    func open(_ request: URLRequest) async throws
        -> (HTTPURLResponse, AsyncThrowingStream<TransportEvent, Error>.AsyncIterator)
    {
        var retry = 0
        while true {
            try Task.checkCancellation()
            var events = Transport.open(request, timeout: timeout).makeAsyncIterator()
            guard case .response(let head)? = try await events.next() else {
                try Task.checkCancellation()
                throw EdgespecError.connection("the connection closed before a response")
            }
            if (200..<300).contains(head.statusCode) {
                return (head, events)
            }
            let body = try await Transport.collect(&events)
            let error = EdgespecError.from(status: head.statusCode, body: body,
                                           retryAfter: head.value(forHTTPHeaderField: "Retry-After"))
            retry += 1
            guard let delay = retryPolicy.delay(beforeRetry: retry, after: error) else { throw error }
            try await Task.sleep(nanoseconds: UInt64(delay * 1_000_000_000))
        }
    }

    func fetch<T: Decodable>(_ request: URLRequest) async throws -> T {
        var (_, events) = try await open(request)
        let body = try await Transport.collect(&events)
        do {
            return try JSONDecoder().decode(T.self, from: body)
        } catch {
            throw EdgespecError.decoding("\(T.self): \(error); body: \(String(decoding: body.prefix(500), as: UTF8.self))")
        }
    }

    func events<Chunk: Decodable & Sendable>(encoding makeRequest: () throws -> URLRequest)
        -> AsyncThrowingStream<Chunk, Error>
    {
        let request: URLRequest
        do {
            request = try makeRequest()
        } catch {
            return AsyncThrowingStream { $0.finish(throwing: error) }
        }
        let client = self
        return AsyncThrowingStream { continuation in
            let task = Task {
                do {
                    var (_, events) = try await client.open(request)
                    var decoder = SSEChunkDecoder<Chunk>()
                    while !decoder.done, let event = try await events.next() {
                        guard case .data(let bytes) = event else { continue }
                        for chunk in decoder.feed(bytes) {
                            continuation.yield(chunk)
                        }
                    }
                    if !decoder.done { try Task.checkCancellation() }
                    for chunk in try decoder.finish() {
                        continuation.yield(chunk)
                    }
                    continuation.finish()
                } catch {
                    continuation.finish(throwing: error)
                }
            }
            // The consumer went away (its task was cancelled, or it stopped iterating):
            // cancelling the reader ends the transport stream, which closes the connection.
            continuation.onTermination = { _ in task.cancel() }
        }
    }
}
