import Foundation

// Request and response shapes of `edgespec serve` (docs/server.md). Swift names are
// camelCase; every type spells its JSON keys out, so no key strategy is needed.

// MARK: - Messages

public struct ChatMessage: Codable, Sendable, Equatable {
    public enum Role: String, Codable, Sendable {
        case system, developer, user, assistant
    }

    public var role: Role
    public var content: String

    public init(role: Role, content: String) {
        self.role = role
        self.content = content
    }

    public static func system(_ content: String) -> ChatMessage { ChatMessage(role: .system, content: content) }
    public static func user(_ content: String) -> ChatMessage { ChatMessage(role: .user, content: content) }
    public static func assistant(_ content: String) -> ChatMessage { ChatMessage(role: .assistant, content: content) }
}

// MARK: - Options

/// A decoding mode: any of `/health`'s `modes`. `auto` (the server's default) is the
/// adaptive decoder; every mode gives the model's own output.
public struct DecodingMode: RawRepresentable, Codable, Hashable, Sendable, ExpressibleByStringLiteral,
    CustomStringConvertible
{
    public let rawValue: String
    public init(rawValue: String) { self.rawValue = rawValue }
    public init(stringLiteral value: String) { self.rawValue = value }
    public var description: String { rawValue }

    public static let auto = DecodingMode(rawValue: "auto")
    public static let adaptive = DecodingMode(rawValue: "adaptive")
    public static let plain = DecodingMode(rawValue: "plain")
    public static let speculative = DecodingMode(rawValue: "speculative")
    public static let lookahead = DecodingMode(rawValue: "lookahead")
    public static let promptLookup = DecodingMode(rawValue: "prompt_lookup")
    public static let tree = DecodingMode(rawValue: "tree")
    public static let cascade = DecodingMode(rawValue: "cascade")

    public init(from decoder: Decoder) throws {
        rawValue = try decoder.singleValueContainer().decode(String.self)
    }

    public func encode(to encoder: Encoder) throws {
        var c = encoder.singleValueContainer()
        try c.encode(rawValue)
    }
}

/// Draft length of the speculative modes: `"auto"` or a fixed K in 1...16.
public enum DraftTokens: Codable, Hashable, Sendable {
    case auto
    case fixed(Int)

    public init(from decoder: Decoder) throws {
        let c = try decoder.singleValueContainer()
        if let k = try? c.decode(Int.self) {
            self = .fixed(k)
        } else if try c.decode(String.self) == "auto" {
            self = .auto
        } else {
            throw DecodingError.dataCorruptedError(in: c, debugDescription: "draft_tokens is \"auto\" or an integer")
        }
    }

    public func encode(to encoder: Encoder) throws {
        var c = encoder.singleValueContainer()
        switch self {
        case .auto: try c.encode("auto")
        case .fixed(let k): try c.encode(k)
        }
    }
}

/// One value of `mode_options` (the mode's own settings, e.g. lookahead's `window`).
public enum ModeOptionValue: Codable, Hashable, Sendable, ExpressibleByIntegerLiteral,
    ExpressibleByFloatLiteral, ExpressibleByStringLiteral, ExpressibleByBooleanLiteral
{
    case int(Int)
    case double(Double)
    case string(String)
    case bool(Bool)

    public init(integerLiteral value: Int) { self = .int(value) }
    public init(floatLiteral value: Double) { self = .double(value) }
    public init(stringLiteral value: String) { self = .string(value) }
    public init(booleanLiteral value: Bool) { self = .bool(value) }

    public init(from decoder: Decoder) throws {
        let c = try decoder.singleValueContainer()
        if let b = try? c.decode(Bool.self) {
            self = .bool(b)
        } else if let i = try? c.decode(Int.self) {
            self = .int(i)
        } else if let d = try? c.decode(Double.self) {
            self = .double(d)
        } else {
            self = .string(try c.decode(String.self))
        }
    }

    public func encode(to encoder: Encoder) throws {
        var c = encoder.singleValueContainer()
        switch self {
        case .int(let v): try c.encode(v)
        case .double(let v): try c.encode(v)
        case .string(let v): try c.encode(v)
        case .bool(let v): try c.encode(v)
        }
    }
}

/// Decoding and sampling options shared by chat and completions. `nil` leaves the field
/// out, so the server's default applies (greedy, `auto`, 256 tokens unless
/// `edgespec serve` was started with other defaults). Values are checked by the server:
/// an out-of-range value is an `EdgespecError.badRequest` naming the field.
public struct GenerationOptions: Sendable, Equatable {
    public var maxTokens: Int?
    /// 0 = greedy; up to 2.
    public var temperature: Double?
    /// In (0, 1]; 1 = off.
    public var topP: Double?
    /// 0 = off.
    public var topK: Int?
    /// In [0, 1); 0 = off.
    public var minP: Double?
    public var seed: UInt64?
    /// Up to 4 strings; the stop string itself is never part of the reply.
    public var stop: [String]?
    public var mode: DecodingMode?
    public var draftTokens: DraftTokens?
    public var modeOptions: [String: ModeOptionValue]?

    public init(maxTokens: Int? = nil, temperature: Double? = nil, topP: Double? = nil, topK: Int? = nil,
                minP: Double? = nil, seed: UInt64? = nil, stop: [String]? = nil, mode: DecodingMode? = nil,
                draftTokens: DraftTokens? = nil, modeOptions: [String: ModeOptionValue]? = nil)
    {
        self.maxTokens = maxTokens
        self.temperature = temperature
        self.topP = topP
        self.topK = topK
        self.minP = minP
        self.seed = seed
        self.stop = stop
        self.mode = mode
        self.draftTokens = draftTokens
        self.modeOptions = modeOptions
    }

    enum Keys: String, CodingKey {
        case maxTokens = "max_tokens", temperature, topP = "top_p", topK = "top_k", minP = "min_p", seed, stop
        case mode, draftTokens = "draft_tokens", modeOptions = "mode_options"
    }

    func encode(into c: inout KeyedEncodingContainer<RequestKey>) throws {
        try c.encodeIfPresent(maxTokens, forKey: RequestKey(Keys.maxTokens))
        try c.encodeIfPresent(temperature, forKey: RequestKey(Keys.temperature))
        try c.encodeIfPresent(topP, forKey: RequestKey(Keys.topP))
        try c.encodeIfPresent(topK, forKey: RequestKey(Keys.topK))
        try c.encodeIfPresent(minP, forKey: RequestKey(Keys.minP))
        try c.encodeIfPresent(seed, forKey: RequestKey(Keys.seed))
        try c.encodeIfPresent(stop, forKey: RequestKey(Keys.stop))
        try c.encodeIfPresent(mode, forKey: RequestKey(Keys.mode))
        try c.encodeIfPresent(draftTokens, forKey: RequestKey(Keys.draftTokens))
        try c.encodeIfPresent(modeOptions, forKey: RequestKey(Keys.modeOptions))
    }
}

/// Top-level keys of a request body (the options are flattened into it).
struct RequestKey: CodingKey {
    var stringValue: String
    var intValue: Int? { nil }
    init(_ name: String) { stringValue = name }
    init<K: CodingKey>(_ key: K) { stringValue = key.stringValue }
    init?(stringValue: String) { self.stringValue = stringValue }
    init?(intValue: Int) { return nil }
}

struct StreamOptions: Encodable {
    let includeUsage: Bool
    enum CodingKeys: String, CodingKey { case includeUsage = "include_usage" }
}

// MARK: - Requests

/// `POST /v1/chat/completions`. `stream` is set by the client method you call.
public struct ChatRequest: Encodable, Sendable, Equatable {
    public var model: String
    public var messages: [ChatMessage]
    public var options: GenerationOptions
    /// Streaming only: ask for a final chunk with token counts (`stream_options.include_usage`).
    public var includeUsage: Bool
    var stream = false

    public init(model: String = "default", messages: [ChatMessage], options: GenerationOptions = .init(),
                includeUsage: Bool = true)
    {
        self.model = model
        self.messages = messages
        self.options = options
        self.includeUsage = includeUsage
    }

    public func encode(to encoder: Encoder) throws {
        var c = encoder.container(keyedBy: RequestKey.self)
        try c.encode(model, forKey: RequestKey("model"))
        try c.encode(messages, forKey: RequestKey("messages"))
        try options.encode(into: &c)
        try c.encode(stream, forKey: RequestKey("stream"))
        if stream && includeUsage {
            try c.encode(StreamOptions(includeUsage: true), forKey: RequestKey("stream_options"))
        }
    }
}

/// `POST /v1/completions`: raw continuation, no chat template.
public struct CompletionRequest: Encodable, Sendable, Equatable {
    public enum Prompt: Sendable, Equatable {
        case text(String)
        case tokens([Int])
    }

    public var model: String
    public var prompt: Prompt
    public var options: GenerationOptions
    public var includeUsage: Bool
    var stream = false

    public init(model: String = "default", prompt: String, options: GenerationOptions = .init(),
                includeUsage: Bool = true)
    {
        self.init(model: model, prompt: .text(prompt), options: options, includeUsage: includeUsage)
    }

    public init(model: String = "default", prompt: Prompt, options: GenerationOptions = .init(),
                includeUsage: Bool = true)
    {
        self.model = model
        self.prompt = prompt
        self.options = options
        self.includeUsage = includeUsage
    }

    public func encode(to encoder: Encoder) throws {
        var c = encoder.container(keyedBy: RequestKey.self)
        try c.encode(model, forKey: RequestKey("model"))
        switch prompt {
        case .text(let s): try c.encode(s, forKey: RequestKey("prompt"))
        case .tokens(let ids): try c.encode(ids, forKey: RequestKey("prompt"))
        }
        try options.encode(into: &c)
        try c.encode(stream, forKey: RequestKey("stream"))
        if stream && includeUsage {
            try c.encode(StreamOptions(includeUsage: true), forKey: RequestKey("stream_options"))
        }
    }
}

// MARK: - Responses

/// Why a reply ended: `stop` (end of turn or a stop string) or `length` (`max_tokens` or
/// the context window).
public struct FinishReason: RawRepresentable, Codable, Hashable, Sendable, CustomStringConvertible {
    public let rawValue: String
    public init(rawValue: String) { self.rawValue = rawValue }
    public var description: String { rawValue }
    public static let stop = FinishReason(rawValue: "stop")
    public static let length = FinishReason(rawValue: "length")

    public init(from decoder: Decoder) throws {
        rawValue = try decoder.singleValueContainer().decode(String.self)
    }

    public func encode(to encoder: Encoder) throws {
        var c = encoder.singleValueContainer()
        try c.encode(rawValue)
    }
}

public struct Usage: Codable, Sendable, Equatable {
    public let promptTokens: Int
    public let completionTokens: Int
    public let totalTokens: Int

    enum CodingKeys: String, CodingKey {
        case promptTokens = "prompt_tokens", completionTokens = "completion_tokens", totalTokens = "total_tokens"
    }
}

/// edgespec's own decoding statistics (the `edgespec` field of a reply and of the final
/// streamed chunk).
public struct EdgespecStats: Codable, Sendable, Equatable {
    public let mode: String
    /// `nil` when the mode drafts nothing.
    public let acceptanceRate: Double?
    public let tokensPerPass: Double?
    public let tokensPerS: Double?
    public let verifierPasses: Int?
    public let drafted: Int?
    public let accepted: Int?
    /// `nil` when the mode drafts nothing.
    public let draftTokens: Int?
    public let prefillS: Double?
    public let decodeS: Double?
    /// Seconds the request waited for the engine.
    public let queueS: Double?
    public let notes: [String]?

    enum CodingKeys: String, CodingKey {
        case mode, acceptanceRate = "acceptance_rate", tokensPerPass = "tokens_per_pass"
        case tokensPerS = "tokens_per_s", verifierPasses = "verifier_passes", drafted, accepted
        case draftTokens = "draft_tokens", prefillS = "prefill_s", decodeS = "decode_s", queueS = "queue_s"
        case notes
    }
}

public struct ChatCompletion: Decodable, Sendable, Equatable {
    public struct Choice: Decodable, Sendable, Equatable {
        public let index: Int
        public let message: ChatMessage
        public let finishReason: FinishReason?
        enum CodingKeys: String, CodingKey { case index, message, finishReason = "finish_reason" }
    }

    public let id: String
    public let object: String
    public let created: Int
    /// The served model's id, also when the request said `"default"`.
    public let model: String
    public let choices: [Choice]
    public let usage: Usage?
    public let edgespec: EdgespecStats?

    /// The reply's text.
    public var text: String { choices.first?.message.content ?? "" }
    public var finishReason: FinishReason? { choices.first?.finishReason }
}

public struct ChatCompletionChunk: Decodable, Sendable, Equatable {
    public struct Delta: Decodable, Sendable, Equatable {
        public let role: ChatMessage.Role?
        public let content: String?
    }

    public struct Choice: Decodable, Sendable, Equatable {
        public let index: Int
        public let delta: Delta
        public let finishReason: FinishReason?
        enum CodingKeys: String, CodingKey { case index, delta, finishReason = "finish_reason" }
    }

    public let id: String
    public let object: String
    public let created: Int
    public let model: String
    public let choices: [Choice]
    /// Only on the last chunk, when `includeUsage` was set (its `choices` are empty).
    public let usage: Usage?
    /// Only on the chunk that carries the finish reason.
    public let edgespec: EdgespecStats?

    /// The piece of text this chunk adds (often empty: the role chunk, the final chunks).
    public var text: String { choices.map { $0.delta.content ?? "" }.joined() }
    public var finishReason: FinishReason? { choices.lazy.compactMap(\.finishReason).first }
}

public struct Completion: Decodable, Sendable, Equatable {
    public struct Choice: Decodable, Sendable, Equatable {
        public let index: Int
        public let text: String
        public let finishReason: FinishReason?
        enum CodingKeys: String, CodingKey { case index, text, finishReason = "finish_reason" }
    }

    public let id: String
    public let object: String
    public let created: Int
    public let model: String
    public let choices: [Choice]
    public let usage: Usage?
    public let edgespec: EdgespecStats?

    public var text: String { choices.map(\.text).joined() }
    public var finishReason: FinishReason? { choices.lazy.compactMap(\.finishReason).first }
}

/// A streamed completion chunk has the same shape as a whole completion, with `usage`
/// only on the last chunk and `edgespec` on the one with the finish reason.
public typealias CompletionChunk = Completion

public struct ModelInfo: Codable, Sendable, Equatable {
    public let id: String
    public let object: String
    public let created: Int
    public let ownedBy: String
    enum CodingKeys: String, CodingKey { case id, object, created, ownedBy = "owned_by" }
}

struct ModelList: Decodable {
    let data: [ModelInfo]
}

/// `GET /health`.
public struct Health: Decodable, Sendable, Equatable {
    public struct Queue: Decodable, Sendable, Equatable {
        public let running: Int
        public let waiting: Int
        public let maxWaiting: Int
        public let submitted: Int
        public let completed: Int
        public let cancelled: Int
        public let refused: Int
        public let failed: Int
        enum CodingKeys: String, CodingKey {
            case running, waiting, maxWaiting = "max_waiting", submitted, completed, cancelled, refused, failed
        }
    }

    /// The store of earlier replies that mode `auto` drafts from.
    public struct History: Decodable, Sendable, Equatable {
        /// `memory`, `disk` or `off`.
        public let mode: String
        public let documents: Int?
        public let bytes: Int?
        public let maxBytes: Int?
        enum CodingKeys: String, CodingKey { case mode, documents, bytes, maxBytes = "max_bytes" }
    }

    public let status: String
    public let model: String
    public let modes: [String]
    public let queue: Queue
    public let history: History?
}
