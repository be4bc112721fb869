// swift-tools-version:5.9
// EdgespecKit: a Swift client for `edgespec serve` and a manager for its process.
// No dependencies beyond the toolchain (Foundation, FoundationNetworking on Linux, XCTest).
import PackageDescription

let package = Package(
    name: "EdgespecKit",
    platforms: [.macOS(.v13), .iOS(.v16)],
    products: [
        .library(name: "EdgespecKit", targets: ["EdgespecKit"]),
        .executable(name: "edgespec-swift-example", targets: ["EdgespecExample"]),
    ],
    targets: [
        .target(name: "EdgespecKit"),
        .executableTarget(name: "EdgespecExample", dependencies: ["EdgespecKit"]),
        .testTarget(name: "EdgespecKitTests", dependencies: ["EdgespecKit"]),
    ]
)
