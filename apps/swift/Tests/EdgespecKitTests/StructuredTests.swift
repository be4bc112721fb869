import Foundation
import XCTest
@testable import EdgespecKit

/// The reply in the shape of a `Decodable` type.
struct Forecast: StructuredOutput, Equatable {
    let city: String
    let days: Int
    let sunny: Bool

    static let jsonSchema: JSONValue = [
        "type": "object",
        "properties": [
            "city": ["enum": ["Paris", "Rome", "Oslo"]],
            "days": ["type": "integer", "minimum": 1, "maximum": 9],
            "sunny": ["type": "boolean"],
        ],
        "required": ["city", "days", "sunny"],
        "additionalProperties": false,
    ]
}

/// Structured output and tool calls against a real `edgespec serve` on the tiny-json bundle
/// (tests/swift_fixture.py), compared with the Python API's replies.
final class StructuredTests: XCTestCase {
    var reference: Fixture.Reference.Structured!
    var messages: [ChatMessage]!
    var client: EdgespecClient!

    override func setUp() async throws {
        let all = try Fixture.reference()
        reference = all.structured
        messages = all.messages
        let server = try await Fixture.sharedServer("json", model: reference.bundle)
        client = try server.client(retryPolicy: .none, timeout: 120)
    }

    var tool: Tool {
        Tool(name: reference.call_name, description: "the weather to come", parameters: Forecast.jsonSchema)
    }

    func testSchemaFromTheFixtureIsTheTypesSchema() throws {
        XCTAssertEqual(reference.schema, Forecast.jsonSchema)
    }

    func testReplyDecodesIntoADecodableType() async throws {
        let request = ChatRequest(messages: messages, options: .init(maxTokens: reference.max_tokens))
        let forecast = try await client.chat(request, as: Forecast.self)
        let expected = try JSONDecoder().decode(Forecast.self, from: Data(reference.schema_text.utf8))
        XCTAssertEqual(forecast, expected)

        // The same schema given as a response format: the reply's text is the Python API's.
        let raw = ChatRequest(messages: messages, options: .init(maxTokens: reference.max_tokens),
                              responseFormat: .jsonSchema(name: "Forecast", schema: Forecast.jsonSchema))
        let reply = try await client.chat(raw)
        XCTAssertEqual(reply.text, reference.schema_text)
        XCTAssertEqual(reply.finishReason, .stop)
        XCTAssertEqual(try reply.decode(Forecast.self), expected)
    }

    func testNamedToolCallIsParsedAndItsArgumentsDecode() async throws {
        let request = ChatRequest(messages: messages, options: .init(maxTokens: reference.max_tokens), tools: [tool],
                                  toolChoice: .function(reference.call_name))
        let reply = try await client.chat(request)
        XCTAssertEqual(reply.finishReason, .toolCalls)
        let call = try XCTUnwrap(reply.toolCalls.first)
        XCTAssertEqual(reply.toolCalls.count, 1)
        XCTAssertEqual(call.function.name, reference.call_name)
        XCTAssertTrue(call.id.hasPrefix("call_"), call.id)
        XCTAssertEqual(call.type, "function")
        XCTAssertEqual(try call.decodeArguments(Forecast.self),
                       try JSONDecoder().decode(Forecast.self, from: Data(reference.call_arguments.utf8)))
        XCTAssertEqual(reply.choices.first?.message.content, "", "a reply of calls only has no text")
    }

    func testStreamedToolCallDeltasJoinToTheCall() async throws {
        let request = ChatRequest(messages: messages, options: .init(maxTokens: reference.max_tokens), tools: [tool],
                                  toolChoice: .function(reference.call_name))
        var accumulator = ToolCallAccumulator()
        var finish: FinishReason?
        var deltas = 0
        for try await chunk in client.streamChat(request) {
            accumulator.add(chunk)
            deltas += chunk.choices.reduce(0) { $0 + ($1.delta.toolCalls?.count ?? 0) }
            finish = chunk.finishReason ?? finish
        }
        XCTAssertEqual(finish, .toolCalls)
        XCTAssertGreaterThanOrEqual(deltas, 2, "the id and name first, then the arguments")
        let calls = accumulator.toolCalls
        XCTAssertEqual(calls.count, 1)
        XCTAssertEqual(calls.first?.function.name, reference.call_name)
        XCTAssertEqual(try calls.first?.decodeArguments(JSONValue.self), try JSONValue(json: reference.call_arguments))
    }

    func testToolResultRoundTripEqualsThePythonAPI() async throws {
        let call = ToolCall(id: reference.call_id, name: reference.call_name, arguments: reference.call_arguments)
        let history = messages + [ChatMessage(role: .assistant, content: "", toolCalls: [call]),
                                  .tool("sunny", callId: reference.call_id)]
        let reply = try await client.chat(ChatRequest(messages: history,
                                                      options: .init(maxTokens: reference.answer_max_tokens),
                                                      tools: [tool]))
        XCTAssertEqual(reply.text, reference.answer_text)
        XCTAssertEqual(reply.usage?.promptTokens, reference.answer_prompt_tokens)
    }

    func testABadSchemaIsABadRequestNamingTheField() async throws {
        let request = ChatRequest(messages: messages, options: .init(maxTokens: 4),
                                  responseFormat: .jsonSchema(name: "x", schema: ["type": "no-such-type"]))
        let error = await caught { try await self.client.chat(request) }
        guard case .badRequest(let body)? = error as? EdgespecError else {
            return XCTFail("expected a bad request, got \(String(describing: error))")
        }
        XCTAssertEqual(body.param, "response_format")
    }
}
