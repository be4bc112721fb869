import Foundation

// Request and response shapes of `edgespec serve` (docs/server.md). Swift names are
// camelCase; every type spells its JSON keys out, so no key strategy is needed.

// MARK: - Messages

public struct ChatMessage: Codable, Sendable, Equatable {
    public enum Role: String, Codable, Sendable {
        case system, developer, user, assistant, tool
    }

    public var role: Role
    /// The text ("" on an assistant message that only calls tools: the server sends null there).
    public var content: String
    /// An assistant message's tool calls (a reply to a request with `tools`, or one sent back
    /// with the conversation).
    public var toolCalls: [ToolCall]?
    /// A `.tool` message: the id of the call it answers.
    public var toolCallId: String?

    public init(role: Role, content: String, toolCalls: [ToolCall]? = nil, toolCallId: String? = nil) {
        self.role = role
        self.content = content
        self.toolCalls = toolCalls
        self.toolCallId = toolCallId
    }

    public static func system(_ content: String) -> ChatMessage { ChatMessage(role: .system, content: content) }
    public static func user(_ content: String) -> ChatMessage { ChatMessage(role: .user, content: content) }
    public static func assistant(_ content: String) -> ChatMessage { ChatMessage(role: .assistant, content: content) }
    /// The result of the call `id`, sent back for the model to answer from.
    public static func tool(_ content: String, callId: String) -> ChatMessage {
        ChatMessage(role: .tool, content: content, toolCallId: callId)
    }

    enum CodingKeys: String, CodingKey { case role, content, toolCalls = "tool_calls", toolCallId = "tool_call_id" }

    public init(from decoder: Decoder) throws {
        let c = try decoder.container(keyedBy: CodingKeys.self)
        role = try c.decode(Role.self, forKey: .role)
        content = try c.decodeIfPresent(String.self, forKey: .content) ?? ""
        toolCalls = try c.decodeIfPresent([ToolCall].self, forKey: .toolCalls)
        toolCallId = try c.decodeIfPresent(String.self, forKey: .toolCallId)
    }

    public func encode(to encoder: Encoder) throws {
        var c = encoder.container(keyedBy: CodingKeys.self)
        try c.encode(role, forKey: .role)
        try c.encode(content, forKey: .content)
        if let toolCalls, !toolCalls.isEmpty { try c.encode(toolCalls, forKey: .toolCalls) }
        try c.encodeIfPresent(toolCallId, forKey: .toolCallId)
    }
}

// MARK: - JSON values, structured output and tools

/// Any JSON value: a JSON schema, a tool's parameters, a call's arguments. Objects keep
/// their keys in the order given (a schema's property order is the order the reply
/// writes them in), also when sent: request bodies are written by `jsonText`.
public indirect enum JSONValue: Codable, Sendable, Hashable, ExpressibleByStringLiteral, ExpressibleByIntegerLiteral,
    ExpressibleByFloatLiteral, ExpressibleByBooleanLiteral, ExpressibleByArrayLiteral, ExpressibleByDictionaryLiteral,
    ExpressibleByNilLiteral
{
    case null
    case bool(Bool)
    case int(Int)
    case double(Double)
    case string(String)
    case array([JSONValue])
    case object(JSONObject)

    public init(stringLiteral value: String) { self = .string(value) }
    public init(integerLiteral value: Int) { self = .int(value) }
    public init(floatLiteral value: Double) { self = .double(value) }
    public init(booleanLiteral value: Bool) { self = .bool(value) }
    public init(arrayLiteral elements: JSONValue...) { self = .array(elements) }
    public init(dictionaryLiteral elements: (String, JSONValue)...) {
        self = .object(JSONObject(elements))
    }
    public init(nilLiteral: ()) { self = .null }

    /// Parses JSON text.
    public init(json: String) throws {
        self = try JSONDecoder().decode(JSONValue.self, from: Data(json.utf8))
    }

    public init(from decoder: Decoder) throws {
        if let c = try? decoder.container(keyedBy: AnyKey.self) {
            var members: [(String, JSONValue)] = []
            for key in c.allKeys { members.append((key.stringValue, try c.decode(JSONValue.self, forKey: key))) }
            self = .object(JSONObject(members))
            return
        }
        let c = try decoder.singleValueContainer()
        if c.decodeNil() {
            self = .null
        } else if let b = try? c.decode(Bool.self) {
            self = .bool(b)
        } else if let i = try? c.decode(Int.self) {
            self = .int(i)
        } else if let d = try? c.decode(Double.self) {
            self = .double(d)
        } else if let s = try? c.decode(String.self) {
            self = .string(s)
        } else {
            self = .array(try c.decode([JSONValue].self))
        }
    }

    public func encode(to encoder: Encoder) throws {
        switch self {
        case .object(let o):
            var c = encoder.container(keyedBy: AnyKey.self)
            for m in o.members { try c.encode(m.value, forKey: AnyKey(m.key)) }
        default:
            var c = encoder.singleValueContainer()
            switch self {
            case .null: try c.encodeNil()
            case .bool(let v): try c.encode(v)
            case .int(let v): try c.encode(v)
            case .double(let v): try c.encode(v)
            case .string(let v): try c.encode(v)
            case .array(let v): try c.encode(v)
            case .object: break
            }
        }
    }

    /// A value of a `Decodable` type read from this JSON.
    public func decode<T: Decodable>(_ type: T.Type = T.self) throws -> T {
        try JSONDecoder().decode(T.self, from: Data(jsonText.utf8))
    }

    /// The value as JSON text, object keys in their order.
    public var jsonText: String {
        var out = ""
        write(to: &out)
        return out
    }

    func write(to out: inout String) {
        switch self {
        case .null: out += "null"
        case .bool(let v): out += v ? "true" : "false"
        case .int(let v): out += String(v)
        case .double(let v): out += v.isFinite ? String(v) : "null"
        case .string(let v): Self.quote(v, into: &out)
        case .array(let items):
            out += "["
            for (i, item) in items.enumerated() {
                if i > 0 { out += "," }
                item.write(to: &out)
            }
            out += "]"
        case .object(let o):
            out += "{"
            for (i, m) in o.members.enumerated() {
                if i > 0 { out += "," }
                Self.quote(m.key, into: &out)
                out += ":"
                m.value.write(to: &out)
            }
            out += "}"
        }
    }

    static func quote(_ s: String, into out: inout String) {
        out += "\""
        for u in s.unicodeScalars {
            switch u {
            case "\"": out += "\\\""
            case "\\": out += "\\\\"
            case "\n": out += "\\n"
            case "\r": out += "\\r"
            case "\t": out += "\\t"
            default:
                if u.value < 0x20 {
                    out += String(format: "\\u%04x", u.value)
                } else {
                    out.unicodeScalars.append(u)
                }
            }
        }
        out += "\""
    }

    /// The value of `key` in an object (nil otherwise).
    public subscript(key: String) -> JSONValue? {
        if case .object(let o) = self { return o[key] }
        return nil
    }
}

/// A JSON object that keeps its keys in order. Two objects are equal when they hold the
/// same keys and values, in any order.
public struct JSONObject: Sendable, Hashable {
    public struct Member: Sendable, Hashable {
        public let key: String
        public let value: JSONValue
    }

    public private(set) var members: [Member]

    public init(_ pairs: [(String, JSONValue)]) {
        var seen: [String: Int] = [:]
        members = []
        for (k, v) in pairs {
            if let i = seen[k] {
                members[i] = Member(key: k, value: v)
            } else {
                seen[k] = members.count
                members.append(Member(key: k, value: v))
            }
        }
    }

    public subscript(key: String) -> JSONValue? {
        get { members.first(where: { $0.key == key })?.value }
        set {
            if let i = members.firstIndex(where: { $0.key == key }) {
                if let newValue { members[i] = Member(key: key, value: newValue) } else { members.remove(at: i) }
            } else if let newValue {
                members.append(Member(key: key, value: newValue))
            }
        }
    }

    var dictionary: [String: JSONValue] { Dictionary(members.map { ($0.key, $0.value) }, uniquingKeysWith: { _, b in b }) }

    public static func == (a: JSONObject, b: JSONObject) -> Bool { a.dictionary == b.dictionary }
    public func hash(into hasher: inout Hasher) { hasher.combine(dictionary) }
}

struct AnyKey: CodingKey {
    var stringValue: String
    var intValue: Int? { nil }
    init(_ s: String) { stringValue = s }
    init?(stringValue: String) { self.stringValue = stringValue }
    init?(intValue: Int) { return nil }
}

/// A request body whose JSON is written with `JSONValue.jsonText`, so that the schemas in it
/// keep their key order (Foundation's JSONEncoder does not keep it).
protocol OrderedJSONBody: Encodable {
    /// Fields to write in their own order over what JSONEncoder makes of the body.
    var orderedFields: [(String, JSONValue)] { get }
}

extension OrderedJSONBody {
    func jsonBody() throws -> Data {
        let ordered = orderedFields
        if ordered.isEmpty { return try JSONEncoder().encode(self) }
        guard case .object(var o) = try JSONDecoder().decode(JSONValue.self, from: JSONEncoder().encode(self)) else {
            return try JSONEncoder().encode(self)
        }
        for (k, v) in ordered { o[k] = v }
        return Data(JSONValue.object(o).jsonText.utf8)
    }
}

/// A `Decodable` type that states its JSON schema, for `ResponseFormat.type(_:)` and
/// `ChatCompletion.decode(_:)`.
public protocol StructuredOutput: Decodable {
    /// The JSON schema replies must validate against (an object schema).
    static var jsonSchema: JSONValue { get }
    /// The schema's name (default: the type's name).
    static var schemaName: String { get }
}

extension StructuredOutput {
    public static var schemaName: String { String(describing: Self.self) }
}

/// What shape the reply must have (`response_format`): the server constrains decoding,
/// token by token, so the reply always matches.
public enum ResponseFormat: Encodable, Sendable, Equatable {
    /// Free text (the default).
    case text
    /// Any one JSON object.
    case jsonObject
    /// One JSON value that validates against `schema`.
    case jsonSchema(name: String, schema: JSONValue, strict: Bool = true)
    /// Text the whole of which matches a regular expression (an edgespec extension).
    case regex(String)
    /// Text in a context-free grammar, Lark or GBNF syntax (an edgespec extension).
    case grammar(String, syntax: String = "lark")

    /// The schema a `StructuredOutput` type states.
    public static func type<T: StructuredOutput>(_: T.Type) -> ResponseFormat {
        .jsonSchema(name: T.schemaName, schema: T.jsonSchema)
    }

    var json: JSONValue {
        switch self {
        case .text: return ["type": "text"]
        case .jsonObject: return ["type": "json_object"]
        case .jsonSchema(let name, let schema, let strict):
            return ["type": "json_schema",
                    "json_schema": ["name": .string(name), "schema": schema, "strict": .bool(strict)]]
        case .regex(let pattern): return ["type": "regex", "pattern": .string(pattern)]
        case .grammar(let grammar, let syntax):
            return ["type": "grammar", "grammar": .string(grammar), "syntax": .string(syntax)]
        }
    }

    public func encode(to encoder: Encoder) throws { try json.encode(to: encoder) }
}

/// A function the model may call (`tools`): its name, what it does, and a JSON schema of
/// its arguments object.
public struct Tool: Encodable, Sendable, Equatable {
    public var name: String
    public var description: String?
    public var parameters: JSONValue

    public init(name: String, description: String? = nil, parameters: JSONValue = ["type": "object", "properties": [:]]) {
        self.name = name
        self.description = description
        self.parameters = parameters
    }

    var json: JSONValue {
        var function = JSONObject([("name", .string(name))])
        if let description { function["description"] = .string(description) }
        function["parameters"] = parameters
        return ["type": "function", "function": .object(function)]
    }

    public func encode(to encoder: Encoder) throws { try json.encode(to: encoder) }
}

/// Whether and which tool the model calls (`tool_choice`).
public enum ToolChoice: Encodable, Sendable, Equatable {
    /// The model decides (the default with tools).
    case auto
    /// No call: the model answers in words.
    case none
    /// At least one call, its arguments constrained to the tools' schemas.
    case required
    /// A call to this function, its arguments constrained to its schema.
    case function(String)

    public func encode(to encoder: Encoder) throws {
        var c = encoder.singleValueContainer()
        switch self {
        case .auto: try c.encode("auto")
        case .none: try c.encode("none")
        case .required: try c.encode("required")
        case .function(let name):
            let choice: JSONValue = ["type": "function", "function": ["name": .string(name)]]
            try c.encode(choice)
        }
    }
}

/// A call the model made: `arguments` is a JSON object, as text (OpenAI's shape).
public struct ToolCall: Codable, Sendable, Equatable {
    public struct Function: Codable, Sendable, Equatable {
        public var name: String
        public var arguments: String
        public init(name: String, arguments: String) {
            self.name = name
            self.arguments = arguments
        }
    }

    public var id: String
    public var type: String
    public var function: Function

    public init(id: String, name: String, arguments: String) {
        self.id = id
        self.type = "function"
        self.function = Function(name: name, arguments: arguments)
    }

    /// The arguments as a value of a `Decodable` type.
    public func decodeArguments<T: Decodable>(_ type: T.Type = T.self) throws -> T {
        do {
            return try JSONDecoder().decode(T.self, from: Data(function.arguments.utf8))
        } catch {
            throw EdgespecError.decoding("the arguments of \(function.name) as \(T.self): \(error)")
        }
    }
}

/// A piece of a streamed tool call (`delta.tool_calls[i]`): the first piece of call `index`
/// carries its id and name, later pieces more of its arguments.
public struct ToolCallDelta: Decodable, Sendable, Equatable {
    public struct Function: Decodable, Sendable, Equatable {
        public let name: String?
        public let arguments: String?
    }

    public let index: Int
    public let id: String?
    public let type: String?
    public let function: Function?
}

/// Joins streamed `ToolCallDelta`s into whole calls.
public struct ToolCallAccumulator: Sendable {
    private var calls: [Int: ToolCall] = [:]

    public init() {}

    public mutating func add(_ chunk: ChatCompletionChunk) {
        for choice in chunk.choices { for delta in choice.delta.toolCalls ?? [] { add(delta) } }
    }

    public mutating func add(_ delta: ToolCallDelta) {
        var call = calls[delta.index] ?? ToolCall(id: "", name: "", arguments: "")
        if let id = delta.id { call.id = id }
        if let name = delta.function?.name { call.function.name += name }
        if let arguments = delta.function?.arguments { call.function.arguments += arguments }
        calls[delta.index] = call
    }

    /// The calls so far, in index order.
    public var toolCalls: [ToolCall] { calls.keys.sorted().compactMap { calls[$0] } }
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
    /// In [-2, 2]: lowers tokens the reply has used (OpenAI's presence penalty).
    public var presencePenalty: Double?
    /// In [-2, 2]: lowers tokens by how often the reply has used them.
    public var frequencyPenalty: Double?
    /// > 0, 1 = off: the CTRL repetition penalty over prompt and reply (an edgespec extension).
    public var repetitionPenalty: Double?

    public init(maxTokens: Int? = nil, temperature: Double? = nil, topP: Double? = nil, topK: Int? = nil,
                minP: Double? = nil, seed: UInt64? = nil, stop: [String]? = nil, mode: DecodingMode? = nil,
                draftTokens: DraftTokens? = nil, modeOptions: [String: ModeOptionValue]? = nil,
                presencePenalty: Double? = nil, frequencyPenalty: Double? = nil, repetitionPenalty: Double? = nil)
    {
        self.presencePenalty = presencePenalty
        self.frequencyPenalty = frequencyPenalty
        self.repetitionPenalty = repetitionPenalty
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
        case presencePenalty = "presence_penalty", frequencyPenalty = "frequency_penalty"
        case repetitionPenalty = "repetition_penalty"
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
        try c.encodeIfPresent(presencePenalty, forKey: RequestKey(Keys.presencePenalty))
        try c.encodeIfPresent(frequencyPenalty, forKey: RequestKey(Keys.frequencyPenalty))
        try c.encodeIfPresent(repetitionPenalty, forKey: RequestKey(Keys.repetitionPenalty))
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
public struct ChatRequest: OrderedJSONBody, Sendable, Equatable {
    public var model: String
    public var messages: [ChatMessage]
    public var options: GenerationOptions
    /// Streaming only: ask for a final chunk with token counts (`stream_options.include_usage`).
    public var includeUsage: Bool
    /// The reply's shape (JSON schema, any JSON object, regex, grammar); nil: free text.
    public var responseFormat: ResponseFormat?
    /// Functions the model may call; its calls come back in `message.toolCalls`.
    public var tools: [Tool]?
    public var toolChoice: ToolChoice?
    /// false: one call at most.
    public var parallelToolCalls: Bool?
    var stream = false

    public init(model: String = "default", messages: [ChatMessage], options: GenerationOptions = .init(),
                includeUsage: Bool = true, responseFormat: ResponseFormat? = nil, tools: [Tool]? = nil,
                toolChoice: ToolChoice? = nil, parallelToolCalls: Bool? = nil)
    {
        self.model = model
        self.messages = messages
        self.options = options
        self.includeUsage = includeUsage
        self.responseFormat = responseFormat
        self.tools = tools
        self.toolChoice = toolChoice
        self.parallelToolCalls = parallelToolCalls
    }

    var orderedFields: [(String, JSONValue)] {
        var out: [(String, JSONValue)] = []
        if let responseFormat { out.append(("response_format", responseFormat.json)) }
        if let tools { out.append(("tools", .array(tools.map(\.json)))) }
        return out
    }

    public func encode(to encoder: Encoder) throws {
        var c = encoder.container(keyedBy: RequestKey.self)
        try c.encode(model, forKey: RequestKey("model"))
        try c.encode(messages, forKey: RequestKey("messages"))
        try options.encode(into: &c)
        try c.encodeIfPresent(responseFormat, forKey: RequestKey("response_format"))
        try c.encodeIfPresent(tools, forKey: RequestKey("tools"))
        try c.encodeIfPresent(toolChoice, forKey: RequestKey("tool_choice"))
        try c.encodeIfPresent(parallelToolCalls, forKey: RequestKey("parallel_tool_calls"))
        try c.encode(stream, forKey: RequestKey("stream"))
        if stream && includeUsage {
            try c.encode(StreamOptions(includeUsage: true), forKey: RequestKey("stream_options"))
        }
    }
}

/// `POST /v1/completions`: raw continuation, no chat template.
public struct CompletionRequest: OrderedJSONBody, Sendable, Equatable {
    public enum Prompt: Sendable, Equatable {
        case text(String)
        case tokens([Int])
    }

    public var model: String
    public var prompt: Prompt
    public var options: GenerationOptions
    public var includeUsage: Bool
    /// The continuation's shape; nil: free text.
    public var responseFormat: ResponseFormat?
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

    var orderedFields: [(String, JSONValue)] {
        responseFormat.map { [("response_format", $0.json)] } ?? []
    }

    public func encode(to encoder: Encoder) throws {
        var c = encoder.container(keyedBy: RequestKey.self)
        try c.encode(model, forKey: RequestKey("model"))
        switch prompt {
        case .text(let s): try c.encode(s, forKey: RequestKey("prompt"))
        case .tokens(let ids): try c.encode(ids, forKey: RequestKey("prompt"))
        }
        try options.encode(into: &c)
        try c.encodeIfPresent(responseFormat, forKey: RequestKey("response_format"))
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
    /// The reply is tool calls (`message.toolCalls`).
    public static let toolCalls = FinishReason(rawValue: "tool_calls")

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
    /// The tool calls of the first choice (empty when it made none).
    public var toolCalls: [ToolCall] { choices.first?.message.toolCalls ?? [] }

    /// The reply (asked for with a JSON `responseFormat`) as a value of a `Decodable` type.
    public func decode<T: Decodable>(_ type: T.Type = T.self) throws -> T {
        do {
            return try JSONDecoder().decode(T.self, from: Data(text.utf8))
        } catch {
            throw EdgespecError.decoding("the reply as \(T.self): \(error); reply: \(text.prefix(500))")
        }
    }
}

public struct ChatCompletionChunk: Decodable, Sendable, Equatable {
    public struct Delta: Decodable, Sendable, Equatable {
        public let role: ChatMessage.Role?
        public let content: String?
        /// Pieces of tool calls (join them with `ToolCallAccumulator`).
        public let toolCalls: [ToolCallDelta]?
        enum CodingKeys: String, CodingKey { case role, content, toolCalls = "tool_calls" }
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
    /// `true` for a model stored by its hub name (`edgespec pull ORG/NAME`): a request naming it in
    /// `model` is answered by it (loaded on first use); absent for the model the server started with.
    public let stored: Bool?
    enum CodingKeys: String, CodingKey { case id, object, created, ownedBy = "owned_by", stored }

    public var isStored: Bool { stored ?? false }
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
